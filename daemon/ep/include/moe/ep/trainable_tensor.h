// The training state of a layer's tensors: the fp32 master copy and Adam moments
// beside the values the layer computes with (TrainableTensor), and that state as
// checkpoints and live rebalances move it (TensorState).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "moe/kernels/api.h"
#include "moe/kernels/buffer.h"

namespace moe::ep {

using kernels::DType;

// A trainable tensor as checkpoints hold it: fp32 master values and the Adam
// moments (empty without them; bf16 moments widened, exactly).
struct TensorState {
  std::vector<float> master, m, v;
};

// n Adam moments in the backend at src, stored in `dtype`, as fp32 host values.
void moments_to_host(kernels::Backend& be, const void* src, DType dtype, size_t n, float* out);
// The inverse: fp32 host values into `dtype` at dst (bf16: rounded to nearest even).
void moments_to_device(kernels::Backend& be, void* dst, DType dtype, size_t n, const float* in);

// One trainable tensor of a stage: the values the layer computes with, an fp32
// master copy and the optimizer's moments, allocated on first update. The master
// has its own buffer where the stage computes from a bf16-rounded fp32 copy
// (bind with kRoundedCopy); with kIsMaster the stage's buffer is the master, and
// whoever reads it as weights rounds (the expert stage's packed weights do).
// The moments are stored in the layer's OptimizerConfig::moments dtype; read()
// widens them and write() rounds them to it.
enum class ComputeCopy { kIsMaster, kRoundedCopy };

class TrainableTensor {
 public:
  // compute: the stage's buffer of `count` values; sync_master() after loading it.
  // moments: the dtype Adam's moments are kept in (fp32 or bf16).
  void bind(kernels::Backend& be, float* compute, size_t count, ComputeCopy copy, DType moments);
  void sync_master();
  void update(const kernels::OptimizerConfig& cfg, int64_t step, const float* grad);
  // What update() passes to optimizer_step (allocating the moments for Adam).
  kernels::OptimizerArgs optimizer_args(const kernels::OptimizerConfig& cfg, int64_t step, const float* grad);

  // Elements [begin, begin + n) as they cross the wire: the fp32 master values
  // and the Adam moments (zeros before the first update).
  void read(size_t begin, size_t n, float* master, float* m, float* v) const;
  // The inverse: sets master, the compute copy (kRoundedCopy: bf16-rounded) and,
  // given m and v, the moments.
  void write(size_t begin, size_t n, const float* master, const float* m, const float* v);
  // Elements [from, from + n) of src (compute, master, moments) into [to, to + n)
  // of this tensor, bit for bit. Both in the same backend and dtype.
  void copy_range(const TrainableTensor& src, size_t from, size_t to, size_t n);
  void ensure_moments();  // allocates zero Adam moments (else on the first update)

 private:
  kernels::Backend* be_ = nullptr;
  float* compute_ = nullptr;
  size_t count_ = 0;
  DType moments_ = DType::kF32;
  kernels::Buffer master_, m_, v_;  // master_ empty with kIsMaster
};

}  // namespace moe::ep
