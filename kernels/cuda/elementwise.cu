// Element-wise ops: dtype conversion, add, the optimizer steps, replica choice and
// the per-pair scalar maps of the backward.
#include <cmath>

#include "cuda_ops.h"
#include "moe/base/check.h"

namespace moe::kernels::cuda {
namespace {

template <typename In, typename Out>
__global__ void convert_kernel(const In* src, Out* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = from_f32<Out>(to_f32(src[i]));
}

template <typename T>
__global__ void add_kernel(T* dst, const T* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = from_f32<T>(to_f32(dst[i]) + to_f32(src[i]));
}

// FP8 wire rows (types.h): one block of kFp8GroupSize threads per (row, group).
template <typename In>
__global__ void quantize_fp8_kernel(const In* rows, int64_t num_rows, int hidden, uint8_t* wire) {
  __shared__ float amax[kFp8GroupSize];
  const int64_t groups = fp8_groups(hidden), row = blockIdx.x / groups, g = blockIdx.x % groups;
  const int64_t i = g * kFp8GroupSize + threadIdx.x;
  const bool in = i < hidden;
  const float x = in ? to_f32(rows[row * hidden + i]) : 0.0f;
  amax[threadIdx.x] = in && x == x ? fabsf(x) : 0.0f;  // NaN: skipped here, kept below
  __syncthreads();
  for (int stride = kFp8GroupSize / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) amax[threadIdx.x] = fmaxf(amax[threadIdx.x], amax[threadIdx.x + stride]);
    __syncthreads();
  }
  const float scale = amax[0] > 0 ? __fdiv_rn(amax[0], kFp8Max) : 1.0f;
  uint8_t* out = wire + row * static_cast<int64_t>(fp8_row_bytes(hidden));
  if (in) out[i] = f32_to_e4m3(__fdiv_rn(x, scale));
  if (threadIdx.x == 0) memcpy(out + hidden + 4 * g, &scale, 4);
}

template <typename Out>
__global__ void dequantize_fp8_kernel(const uint8_t* wire, int64_t num_rows, int hidden, Out* rows) {
  const int64_t groups = fp8_groups(hidden), row = blockIdx.x / groups, g = blockIdx.x % groups;
  const int64_t i = g * kFp8GroupSize + threadIdx.x;
  if (i >= hidden) return;
  const uint8_t* in = wire + row * static_cast<int64_t>(fp8_row_bytes(hidden));
  float scale;
  memcpy(&scale, in + hidden + 4 * g, 4);
  rows[row * hidden + i] = from_f32<Out>(__fmul_rn(e4m3_to_f32(in[i]), scale));
}

// Grid of at most 64K blocks; the kernels stride over the rest.
unsigned grid_for(int64_t n) { return static_cast<unsigned>(std::min<int64_t>(blocks_for(n), 65535)); }

// Each operation rounded on its own (row_logic's _rn steps, with an explicit fma
// where the CPU backend fuses, and no other contraction): the CPU backend's bits,
// whatever the compiler would fuse, so replicas fed the same gradients stay
// bitwise identical on any build.
// M: the moments' storage (float, or bf16s rounded to nearest even on store);
// the weight moves by the unrounded moments, as the CPU backend's step does.
template <typename M>
__global__ void adam_kernel(int64_t n, AdamConstants p, float* w, const float* g, M* m, M* v,
                            float* rounded) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float wi = w[i], mi = to_f32(m[i]), vi = to_f32(v[i]);
    row_logic::adam_step(p, wi, g[i], mi, vi);
    w[i] = wi;
    m[i] = from_f32<M>(mi);
    v[i] = from_f32<M>(vi);
    if (rounded) rounded[i] = to_f32(bf16_from_f32(wi));
  }
}

__global__ void sgd_kernel(int64_t n, float lr, float* w, const float* g, float* rounded) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float wi = w[i];
    row_logic::sgd_step(lr, wi, g[i]);
    w[i] = wi;
    if (rounded) rounded[i] = to_f32(bf16_from_f32(wi));
  }
}

__global__ void replica_kernel(int64_t T, int K, int E, ReplicaArgs a, DeviceFault* fault) {
  const int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (p >= T * K) return;
  const int32_t e = a.topk_idx[p];
  a.topk_slot[p] = -1;
  if (e < 0) return;
  if (e >= E) return report_fault(fault, FaultOp::kReplicaExpert, p, e, E);
  const int32_t count = a.logcnt[e];
  if (count < 1 || count > a.max_replicas) return report_fault(fault, FaultOp::kReplicaCount, e, count, a.max_replicas);
  a.topk_slot[p] = a.log2phy[int64_t{e} * a.max_replicas + replica_index(a.token_begin + p / K, e, count)];
}

__global__ void unpermute_scalars_kernel(const int32_t* pos, int64_t n, const float* perm, float* pair) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) pair[i] = pos[i] >= 0 ? perm[pos[i]] : 0.0f;
}

__global__ void combine_pair_scalars_kernel(const int32_t* slot, const int32_t* send_row, int64_t T, int K, int R,
                                            int S, const float* rows, float* pair) {
  const int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (p >= T * K) return;
  const int32_t s = slot[p];
  const int64_t t = p / K;
  pair[p] = s < 0 ? 0.0f : rows[int64_t{send_row[t * R + s / S]} * K + p % K];
}

}  // namespace

void convert(CudaExec& ex, const void* src, DType sd, void* dst, DType dd, int64_t count) {
  if (count <= 0) return;
  if (sd == dd) {
    check(cudaMemcpyAsync(dst, src, count * dtype_size(sd), cudaMemcpyDeviceToDevice, ex.stream), "convert");
    return;
  }
  with_dtype(sd, [&](auto in) {
    with_dtype(dd, [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      convert_kernel<<<grid_for(count), kThreads, 0, ex.stream>>>(static_cast<const In*>(src), static_cast<Out*>(dst),
                                                                 count);
    });
  });
  check(cudaGetLastError(), "convert");
}

namespace {

void quantize_fp8_rows(CudaExec& ex, const void* rows, DType dtype, int64_t num_rows, int hidden, void* wire) {
  const int64_t blocks = num_rows * fp8_groups(hidden);
  if (blocks <= 0) return;
  MOE_CHECK(blocks < (int64_t{1} << 31), "quantize_fp8_rows: ", num_rows, " rows is too many for one launch");
  with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    quantize_fp8_kernel<<<static_cast<unsigned>(blocks), kFp8GroupSize, 0, ex.stream>>>(
        static_cast<const T*>(rows), num_rows, hidden, static_cast<uint8_t*>(wire));
  });
  check(cudaGetLastError(), "quantize_fp8_rows");
}

void dequantize_fp8_rows(CudaExec& ex, const void* wire, int64_t num_rows, int hidden, void* rows, DType dtype) {
  const int64_t blocks = num_rows * fp8_groups(hidden);
  if (blocks <= 0) return;
  MOE_CHECK(blocks < (int64_t{1} << 31), "dequantize_fp8_rows: ", num_rows, " rows is too many for one launch");
  with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dequantize_fp8_kernel<<<static_cast<unsigned>(blocks), kFp8GroupSize, 0, ex.stream>>>(
        static_cast<const uint8_t*>(wire), num_rows, hidden, static_cast<T*>(rows));
  });
  check(cudaGetLastError(), "dequantize_fp8_rows");
}

}  // namespace

void pack_rows(CudaExec& ex, WireFormat f, const void* rows, DType dtype, int64_t num_rows, int hidden, void* wire) {
  switch (f) {
    case WireFormat::kF32:
    case WireFormat::kBF16: return convert(ex, rows, dtype, wire, wire_info(f).dtype, num_rows * hidden);
    case WireFormat::kFP8: return quantize_fp8_rows(ex, rows, dtype, num_rows, hidden, wire);
  }
  detail::fail("pack_rows: invalid wire format ", static_cast<int>(f));
}

void unpack_rows(CudaExec& ex, WireFormat f, const void* wire, int64_t num_rows, int hidden, void* rows, DType dtype) {
  switch (f) {
    case WireFormat::kF32:
    case WireFormat::kBF16: return convert(ex, wire, wire_info(f).dtype, rows, dtype, num_rows * hidden);
    case WireFormat::kFP8: return dequantize_fp8_rows(ex, wire, num_rows, hidden, rows, dtype);
  }
  detail::fail("unpack_rows: invalid wire format ", static_cast<int>(f));
}

void add(CudaExec& ex, void* dst, const void* src, DType dtype, int64_t count) {
  if (count <= 0) return;
  with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    add_kernel<<<grid_for(count), kThreads, 0, ex.stream>>>(static_cast<T*>(dst), static_cast<const T*>(src), count);
  });
  check(cudaGetLastError(), "add");
}

void optimizer_step(CudaExec& ex, const OptimizerConfig& cfg, const OptimizerArgs& a) {
  cfg.validate();
  MOE_CHECK(a.step >= 1, "optimizer: step must be >= 1, got ", a.step);
  MOE_CHECK(cfg.kind == OptimizerKind::kSgd || (a.m && a.v), "optimizer: adam needs its moment buffers");
  if (a.count <= 0) return;
  if (cfg.kind == OptimizerKind::kSgd) {
    sgd_kernel<<<grid_for(a.count), kThreads, 0, ex.stream>>>(a.count, cfg.lr, a.weight, a.grad, a.rounded);
  } else {
    const AdamConstants p = adam_constants(cfg, a.step);
    with_dtype(cfg.moments, [&](auto tag) {
      using M = decltype(tag);
      adam_kernel<<<grid_for(a.count), kThreads, 0, ex.stream>>>(a.count, p, a.weight, a.grad, static_cast<M*>(a.m),
                                                                 static_cast<M*>(a.v), a.rounded);
    });
  }
  check(cudaGetLastError(), "optimizer step");
}

void select_replicas(CudaExec& ex, int64_t T, int K, int E, const ReplicaArgs& a) {
  if (T * K <= 0) return;
  replica_kernel<<<blocks_for(T * K), kThreads, 0, ex.stream>>>(T, K, E, a, ex.fault);
  check(cudaGetLastError(), "select_replicas");
}

void unpermute_scalars(CudaExec& ex, const int32_t* pos, int64_t n, int k, const float* perm, float* pair) {
  if (n * k <= 0) return;
  unpermute_scalars_kernel<<<blocks_for(n * k), kThreads, 0, ex.stream>>>(pos, n * k, perm, pair);
  check(cudaGetLastError(), "unpermute_scalars");
}

void combine_pair_scalars(CudaExec& ex, const int32_t* topk_slot, const int32_t* token_send_row, int64_t T, int K,
                          int R, int S, const float* rows, float* pair) {
  if (T * K <= 0) return;
  combine_pair_scalars_kernel<<<blocks_for(T * K), kThreads, 0, ex.stream>>>(topk_slot, token_send_row, T, K, R, S,
                                                                             rows, pair);
  check(cudaGetLastError(), "combine_pair_scalars");
}

}  // namespace moe::kernels::cuda
