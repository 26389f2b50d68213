#include "moe/ep/trainable_tensor.h"

#include <algorithm>

#include "moe/base/check.h"
#include "moe/model/synthetic.h"

namespace moe::ep {

using kernels::Buffer;

void moments_to_host(kernels::Backend& be, const void* src, DType dtype, size_t n, float* out) {
  if (dtype == DType::kF32) return be.copy_to_host(out, src, 4 * n);
  std::vector<kernels::bf16_t> bits(n);
  be.copy_to_host(bits.data(), src, 2 * n);
  std::transform(bits.begin(), bits.end(), out, kernels::bf16_to_f32);
}

void moments_to_device(kernels::Backend& be, void* dst, DType dtype, size_t n, const float* in) {
  if (dtype == DType::kF32) return be.copy_to_device(dst, in, 4 * n);
  std::vector<kernels::bf16_t> bits(n);
  std::transform(in, in + n, bits.begin(), kernels::f32_to_bf16);
  be.copy_to_device(dst, bits.data(), 2 * n);
}

void TrainableTensor::bind(kernels::Backend& be, float* compute, size_t count, ComputeCopy copy, DType moments) {
  MOE_CHECK(moments == DType::kF32 || moments == DType::kBF16, "trainable tensor: moments must be fp32 or bf16");
  be_ = &be;
  compute_ = compute;
  count_ = count;
  moments_ = moments;
  if (copy == ComputeCopy::kRoundedCopy) master_ = Buffer(be, 4 * count);
}

void TrainableTensor::sync_master() {
  if (master_.get()) be_->copy(master_.get(), compute_, 4 * count_);
}

void TrainableTensor::ensure_moments() {
  if (m_.get() || !count_) return;
  const size_t bytes = kernels::dtype_size(moments_) * count_;
  m_ = Buffer(*be_, bytes);
  v_ = Buffer(*be_, bytes);
  be_->fill_zero(m_.get(), bytes);
  be_->fill_zero(v_.get(), bytes);
}

void TrainableTensor::read(size_t begin, size_t n, float* master, float* m, float* v) const {
  const float* src = master_.get() ? master_.as<float>() : compute_;
  be_->copy_to_host(master, src + begin, 4 * n);
  const size_t at = kernels::dtype_size(moments_) * begin;
  if (m && m_.get()) moments_to_host(*be_, m_.as<uint8_t>() + at, moments_, n, m);
  else if (m) std::fill_n(m, n, 0.0f);
  if (v && v_.get()) moments_to_host(*be_, v_.as<uint8_t>() + at, moments_, n, v);
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
  const size_t at = kernels::dtype_size(moments_) * begin;
  moments_to_device(*be_, m_.as<uint8_t>() + at, moments_, n, m);
  moments_to_device(*be_, v_.as<uint8_t>() + at, moments_, n, v);
}

void TrainableTensor::copy_range(const TrainableTensor& src, size_t from, size_t to, size_t n) {
  MOE_ASSERT(src.moments_ == moments_);
  be_->copy(compute_ + to, src.compute_ + from, 4 * n);
  if (master_.get()) be_->copy(master_.as<float>() + to, src.master_.as<float>() + from, 4 * n);
  const size_t size = kernels::dtype_size(moments_), bytes = size * n;
  if (!src.m_.get()) {
    if (m_.get()) {  // the source has taken no Adam step yet: zero moments
      be_->fill_zero(m_.as<uint8_t>() + size * to, bytes);
      be_->fill_zero(v_.as<uint8_t>() + size * to, bytes);
    }
    return;
  }
  ensure_moments();
  be_->copy(m_.as<uint8_t>() + size * to, src.m_.as<uint8_t>() + size * from, bytes);
  be_->copy(v_.as<uint8_t>() + size * to, src.v_.as<uint8_t>() + size * from, bytes);
}

void TrainableTensor::update(const kernels::OptimizerConfig& cfg, int64_t step, const float* grad) {
  be_->optimizer_step(cfg, optimizer_args(cfg, step, grad));
}

kernels::OptimizerArgs TrainableTensor::optimizer_args(const kernels::OptimizerConfig& cfg, int64_t step,
                                                       const float* grad) {
  if (cfg.kind == kernels::OptimizerKind::kAdam) {
    MOE_CHECK(cfg.moments == moments_, "optimizer: moments in ", kernels::dtype_name(cfg.moments),
              " for a tensor that keeps them in ", kernels::dtype_name(moments_));
    ensure_moments();
  }
  kernels::OptimizerArgs a;
  a.count = static_cast<int64_t>(count_);
  a.step = step;
  a.weight = master_.get() ? master_.as<float>() : compute_;
  a.grad = grad;
  a.m = m_.get();
  a.v = v_.get();
  a.rounded = master_.get() ? compute_ : nullptr;
  return a;
}

}  // namespace moe::ep
