#include "moe/ep/grad_sums.h"

#include "moe/base/check.h"

namespace moe::ep {

void GradSums::add(kernels::Backend& be, const std::vector<Tensor>& grads) {
  if (passes_ == 0) sums_.clear();  // the first pass is copied: no zeros to add to
  MOE_CHECK(sums_.empty() || sums_.size() == grads.size(), "gradient sums of ", sums_.size(), " tensors, given ",
            grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const size_t bytes = grads[i].count * sizeof(float);
    if (sums_.size() < grads.size()) {
      sums_.emplace_back(be, bytes);
      if (bytes) be.copy(sums_.back().get(), grads[i].grad, bytes);
      continue;
    }
    MOE_CHECK(sums_[i].bytes() == bytes, "gradient tensor ", i, " changed size: ", bytes, " bytes, summed ",
              sums_[i].bytes());
    if (bytes) be.add(sums_[i].get(), grads[i].grad, kernels::DType::kF32, static_cast<int64_t>(grads[i].count));
  }
  ++passes_;
}

bool GradSums::load(kernels::Backend& be, const std::vector<Tensor>& grads) {
  if (passes_ == 0) return false;
  MOE_CHECK(sums_.size() == grads.size(), "gradient sums of ", sums_.size(), " tensors, loading ", grads.size());
  for (size_t i = 0; i < grads.size(); ++i)
    if (grads[i].count) be.copy(grads[i].grad, sums_[i].get(), grads[i].count * sizeof(float));
  passes_ = 0;
  return true;
}

}  // namespace moe::ep
