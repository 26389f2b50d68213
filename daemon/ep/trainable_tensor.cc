#include "moe/ep/trainable_tensor.h"

#include <algorithm>

#include "moe/base/check.h"
#include "moe/model/synthetic.h"

namespace moe::ep {

using kernels::Buffer;

void TrainableTensor::bind(kernels::Backend& be, float* compute, size_t count, ComputeCopy copy) {
  be_ = &be;
  compute_ = compute;
  count_ = count;
  if (copy == ComputeCopy::kRoundedCopy) master_ = Buffer(be, 4 * count);
}

void TrainableTensor::sync_master() {
  if (master_.get()) be_->copy(master_.get(), compute_, 4 * count_);
}

void TrainableTensor::ensure_moments() {
  if (m_.get() || !count_) return;
  m_ = Buffer(*be_, 4 * count_);
  v_ = Buffer(*be_, 4 * count_);
  be_->fill_zero(m_.get(), 4 * count_);
  be_->fill_zero(v_.get(), 4 * count_);
}

void TrainableTensor::read(size_t begin, size_t n, float* master, float* m, float* v) const {
  const float* src = master_.get() ? master_.as<float>() : compute_;
  be_->copy_to_host(master, src + begin, 4 * n);
  if (m && m_.get()) be_->copy_to_host(m, m_.as<float>() + begin, 4 * n);
  else if (m) std::fill_n(m, n, 0.0f);
  if (v && v_.get()) be_->copy_to_host(v, v_.as<float>() + begin, 4 * n);
  else if (v) std::fill_n(v, n, 0.0f);
}

void TrainableTensor::write(size_t begin, size_t n, const float* master, const float* m, const float* v) {
  if (master_.get()) {
    be_->copy_to_device(master_.as<float>() + begin, master, 4 * n);
    std::vector<float> rounded(master, master + n);
    model::round_to_bf16(rounded);
    be_->copy_to_device(compute_ + begin, rounded.data(), 4 * n);
  } else {
    be_->copy_to_device(compute_ + begin, master, 4 * n);
  }
  if (!m || !v) return;
  ensure_moments();
  be_->copy_to_device(m_.as<float>() + begin, m, 4 * n);
  be_->copy_to_device(v_.as<float>() + begin, v, 4 * n);
}

void TrainableTensor::copy_range(const TrainableTensor& src, size_t from, size_t to, size_t n) {
  be_->copy(compute_ + to, src.compute_ + from, 4 * n);
  if (master_.get()) be_->copy(master_.as<float>() + to, src.master_.as<float>() + from, 4 * n);
  if (!src.m_.get()) {
    if (m_.get()) {  // the source has taken no Adam step yet: zero moments
      be_->fill_zero(m_.as<float>() + to, 4 * n);
      be_->fill_zero(v_.as<float>() + to, 4 * n);
    }
    return;
  }
  ensure_moments();
  be_->copy(m_.as<float>() + to, src.m_.as<float>() + from, 4 * n);
  be_->copy(v_.as<float>() + to, src.v_.as<float>() + from, 4 * n);
}

void TrainableTensor::update(const kernels::OptimizerConfig& cfg, int64_t step, const float* grad) {
  if (cfg.kind == kernels::OptimizerKind::kAdam) ensure_moments();
  kernels::OptimizerArgs a;
  a.count = static_cast<int64_t>(count_);
  a.step = step;
  a.weight = master_.get() ? master_.as<float>() : compute_;
  a.grad = grad;
  a.m = m_.as<float>();
  a.v = v_.as<float>();
  a.rounded = master_.get() ? compute_ : nullptr;
  be_->optimizer_step(cfg, a);
}

}  // namespace moe::ep
