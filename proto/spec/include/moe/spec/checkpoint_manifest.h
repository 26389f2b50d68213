// Training checkpoints (docs/jobs.md#checkpoints-and-resume) as the agent, moectl and moed find and check
// them: `{checkpoint_dir}/step-{s:06d}/` holds rank{r}.safetensors,
// router.safetensors and, written last, checkpoint.json (CheckpointManifest).
#pragma once

#include <string>

#include "moe/v1/checkpoint.pb.h"

namespace moe::spec {

inline constexpr const char* kManifestName = "checkpoint.json";

// "step-000012" for 12 steps completed.
std::string step_folder_name(int step);

// A step folder holding checkpoint.json, or a checkpoint_dir: its latest
// complete step folder. Throws moe::Error naming the path when there is none.
std::string resolve_checkpoint(const std::string& path);

// checkpoint.json of a step folder; throws moe::Error naming the file when it is
// missing or malformed.
v1::CheckpointManifest read_manifest(const std::string& folder);
// The manifest in `text` (read from `path`, named in errors): format 1, one valid
// map per layer in order, files named plainly within the folder.
v1::CheckpointManifest manifest_from_json(const std::string& text, const std::string& path);

// Every file the manifest lists exists with the bytes it recorded; throws
// moe::Error naming the first missing or truncated one.
void check_files(const std::string& folder, const v1::CheckpointManifest& m);

// The fields a resumed run may change: steps, checkpoint_*, resume, verify/dump
// fields, tokens_per_rank, name, labels. Any other difference throws moe::Error naming the field.
void check_resume_spec(const v1::JobSpec& checkpoint, const v1::JobSpec& resumed);
// A resumed job must ask for more steps than the checkpoint holds; throws
// moe::InvalidArgument ("steps: ...") otherwise.
void check_resume_steps(const v1::CheckpointManifest& m, const v1::JobSpec& resumed);

// Everything above for a job about to resume: the resolved folder's manifest,
// its files checked, the spec compared.
v1::CheckpointManifest load_for_resume(const v1::JobSpec& resumed, std::string& folder);

}  // namespace moe::spec
