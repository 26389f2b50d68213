// Weight gradients summed over several backwards before one optimizer step: a
// serving job's backward calls (docs/serving.md#training), the way torch's .grad
// accumulates until optimizer.step(). A layer's backward overwrites its gradient
// tensors; add() then sums them into buffers of the same shapes, and load()
// puts the sums back in their place for the optimizer step and starts over.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "moe/kernels/api.h"
#include "moe/kernels/buffer.h"

namespace moe::ep {

class GradSums {
 public:
  struct Tensor {  // one gradient tensor of the layer, fp32 in the backend's memory
    float* grad;
    size_t count;
  };

  // After a backward: sums += grads (the first call after a load starts from
  // them). The tensors must be the same, in the same order, until load().
  void add(kernels::Backend& be, const std::vector<Tensor>& grads);
  // grads = sums, then the sums restart; false (nothing written) when no
  // backward was added since the last load.
  bool load(kernels::Backend& be, const std::vector<Tensor>& grads);
  // Backwards added since the last load.
  int64_t passes() const { return passes_; }

 private:
  std::vector<kernels::Buffer> sums_;
  int64_t passes_ = 0;
};

}  // namespace moe::ep
