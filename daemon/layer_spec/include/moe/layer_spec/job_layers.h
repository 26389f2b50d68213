// The spec-to-layer library (docs/jobs.md#spec), job half: from a JobSpec to the
// things a rank runs: the layer spec and config (through layer_config.h, the one
// place they are built), the weights of a layer (synthetic from the seed, or read
// from a safetensors file), the inputs of a step, the teacher and the optimizer.
// The proto's enums map to the kernels' in exhaustive switches (a new value fails
// to compile until it is mapped). Specs have their defaults filled
// (spec::with_defaults).
#pragma once

#include <string>
#include <vector>

#include "moe/layer_spec/layer_config.h"
#include "moe/kernels/thread_pool.h"
#include "moe/model/synthetic.h"
#include "moe/v1/job.pb.h"

namespace moe::layer_spec {

// The job as the daemon sees it: every fact it needs of the spec, each derived
// in one place (mode, optimizer, dtype, wires and overlap through the exhaustive
// switches below). Holds `spec` by reference: it must outlive the view (a spec
// passed where a view is asked for makes one for the call).
struct JobView {
  JobView(const v1::JobSpec& spec);  // NOLINT(google-explicit-constructor)
  const v1::JobSpec& spec;  // for the functions below that take the whole spec
  bool train;               // mode train (forward + backward + optimizer step)
  bool serve;               // mode serve: layers served to programs until cancelled (docs/serving.md)
  int serve_max_wait_ms;    // serve: a step starts once its oldest row waited this long
  bool adam;                // train with Adam: each trained parameter has moments m, v
  kernels::DType dtype;
  model::LayerShape shape;  // E, H, I, the shared experts' width and gate
  int layers, top_k, steps;
  int64_t tokens_per_rank;
  kernels::WireChoice dispatch_wire, combine_wire;
  int overlap_chunks;
  bool exact_replica_grads;
  double bias_update_rate;
  bool elastic;
  // Outputs: verify and dump at one step, checkpoints every so many, a resume folder.
  bool verify;
  int verify_step;
  std::string dump_dir;
  int dump_step;
  std::string checkpoint_dir;
  int checkpoint_every;
  std::string resume;
  // serve: the calls' routing recorded (docs/example-lm.md#routing-traces); dir "": not.
  std::string inputs;  // forward/train: a routing trace whose layer-0 rows are the tokens ("": synthetic)
  struct Trace {
    std::string dir;
    int64_t tokens;
    bool hidden;
  } trace;
};

ep::LayerSpec layer_spec(const v1::JobSpec& spec);
ep::MoeLayerConfig layer_config(const v1::JobSpec& spec);
kernels::DType job_dtype(const v1::JobSpec& spec);
// The table's format (kernels/wire_format.h) the value names; unset: nullopt, the layer's own.
kernels::WireChoice wire(v1::Wire w);
bool is_train(const v1::JobSpec& spec);
// E, H, I, and the shared experts' total width shared_experts x shared_ffn_hidden.
model::LayerShape layer_shape(const v1::JobSpec& spec);
// The teacher of a train job: the same architecture built from seed + 1.
v1::JobSpec teacher_of(const v1::JobSpec& spec);
kernels::OptimizerConfig optimizer_config(const v1::JobSpec& spec);

// Weights of `layer` for the experts with needed[e] (the router and shared
// experts always). From spec.weights when set (a safetensors file or a sharded
// checkpoint; {layer} in weights_prefix is replaced by weights_first_layer +
// layer, and every tensor of the layer is checked against the spec from the
// headers before the needed ones are read), else synthetic from (seed, layer).
// The skew term is added either way. Throws moe::Error naming the layer, the
// checkpoint and the tensor or field. Synthetic experts are drawn on `pool` when given.
model::LayerWeights layer_weights(const v1::JobSpec& spec, int layer, const std::vector<bool>& needed,
                                  kernels::ThreadPool* pool = nullptr);

// x [T, H] of `rank` at `step` (global tokens rank x T + t), in fp32, rounded to
// bf16 values for a bf16 job.
std::vector<float> step_inputs(const v1::JobSpec& spec, int rank, int step, kernels::ThreadPool& pool);

}  // namespace moe::layer_spec
