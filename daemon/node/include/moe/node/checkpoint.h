// Training checkpoints on one rank (docs/jobs.md#checkpoints-and-resume, docs/formats.md#checkpoints). In `{checkpoint_dir}/step-{s:06d}/`
// every rank writes rank{r}.safetensors (the experts it hosts: fp32 masters and
// Adam moments), rank 0 router.safetensors (per layer the router, its selection
// bias, the shared experts, with their state) and, once every rank's file is
// whole, checkpoint.json (CheckpointManifest) last: a folder without it is never
// taken for a checkpoint. Every file is written atomically (write, fsync, rename).
// The folder must be one path every node and the agent see (a shared filesystem,
// as for Megatron's checkpoints).
//
// Names (`.exp_avg` / `.exp_avg_sq`: Adam's m and v, as PyTorch names them):
//   rank file:   layers.{l}.experts.{e}.{gate_proj,up_proj,down_proj}.weight[.exp_avg|.exp_avg_sq]
//   router file: layers.{l}.gate.weight[...], layers.{l}.gate.e_score_correction_bias,
//                layers.{l}.shared_experts.{gate_proj,up_proj,down_proj}.weight[...],
//                layers.{l}.shared_expert_gate.weight[...]
#pragma once

#include <string>

#include "moe/node/model_stack.h"
#include "moe/v1/checkpoint.pb.h"
#include "moe/v1/job_run.pb.h"

namespace moe::node {

// Collective: every rank of the job calls it after `steps_done` steps.
void write_checkpoint(const v1::StartJob& job, ModelStack& stack, int steps_done, int rank,
                      transport::Communicator& comm, transport::Deadline deadline);

// Loads the checkpoint in `folder` into the stack: the replicated state from the
// router file, and each of this rank's slots from the rank file that holds its
// expert in the checkpoint's map (the stack's maps may differ from it).
void load_checkpoint(const std::string& folder, const v1::CheckpointManifest& m, ModelStack& stack, int rank);

}  // namespace moe::node
