// The dump (docs/formats.md#dumps): rank{r}.safetensors of layer 0 at the covered step
// (dump_step), and spec.json from rank 0.
#pragma once

#include "moe/node/model_stack.h"
#include "moe/layer_spec/job_layers.h"

namespace moe::node {

// Writes job.dump_dir/rank{rank}.safetensors (and spec.json on rank 0).
// Throws moe::Error naming the file when it cannot be written.
// layer0: layer 0's weights as the step used them.
void dump_step(const layer_spec::JobView& job, const ModelStack& stack, const model::LayerWeights& layer0, int rank);

}  // namespace moe::node
