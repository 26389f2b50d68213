// Verify (docs/jobs.md#verify): a rank recomputes the covered step (verify_step) with the fp64 reference,
// layer by layer, with the weights that step used, and compares.
#pragma once

#include "moe/node/model_stack.h"
#include "moe/transport/communicator.h"
#include "moe/layer_spec/job_layers.h"

namespace moe::node {

// Compares every layer's output on this rank's tokens (capacity is per source
// rank, so nobody else's tokens are needed) and, in train mode, grad_x on our
// tokens and the router and expert weight gradients, whose reference sums over
// every rank's tokens: each rank's reference share is all-reduced like the real
// gradients. Collective: every rank calls it. Tolerances (relative to each
// tensor's scale): fp32 1e-4 (accumulation-order noise); bf16 1/64 (out, grad_x
// and each rank's partial combine row are rounded once each, 2^-9); weight
// gradients (fp32 sums over all ranks' tokens) 1e-3 in fp32, 1/64 in bf16 (one
// operand of each term is rounded to bf16 on the oneDNN engine).
// weights: each layer's weights as the step used them (ModelStack::weights_in_use).
v1::Verify verify_step(const layer_spec::JobView& job, const ModelStack& stack, const std::vector<model::LayerWeights>& weights,
                       int rank, transport::Communicator& comm, transport::Deadline deadline);

}  // namespace moe::node
