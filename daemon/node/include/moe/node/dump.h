// The dump (docs/formats.md#dumps): rank{r}.safetensors of layer 0 at the covered step
// (dump_step), and spec.json from rank 0.
#pragma once

#include "moe/node/model_stack.h"
#include "moe/v1/job.pb.h"

namespace moe::node {

// Writes spec.dump_dir/rank{rank}.safetensors (and spec.json on rank 0).
// Throws moe::Error naming the file when it cannot be written.
// layer0: layer 0's weights as the step used them.
void dump_step(const v1::JobSpec& spec, const ModelStack& stack, const model::LayerWeights& layer0, int rank);

}  // namespace moe::node
