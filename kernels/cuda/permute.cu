// Row movement on the GPU: permute (gather rows into expert-major order, converting
// dtype), the expert MLP's gather, and unpermute (the weighted local combine, a
// per-row sum in k order in fp32). One block per output row; each thread moves V
// consecutive elements with vector loads when the rows allow it (V = 8: 16-byte
// bf16 or 32-byte fp32 accesses), one element otherwise.
#include <cstdint>

#include "cuda_ops.h"
#include "moe/base/check.h"

namespace moe::kernels::cuda {
namespace {

constexpr int kRowThreads = 128;
constexpr int kVec = 8;

using row_logic::gather_vec;
using row_logic::unpermute_vec;

unsigned row_grid(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, int64_t{1} << 20)); }

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 32 == 0; }

// out[m] = rows[src[m]] for m in [first, end), each source in [0, num_src).
template <typename In, typename Out, int V>
__global__ void gather_kernel(const In* rows, int H, const int32_t* src, int64_t first, int64_t end, int64_t num_src,
                              Out* out, DeviceFault* fault, FaultOp op) {
  for (int64_t m = first + blockIdx.x; m < end; m += gridDim.x) {
    const int32_t s = src[m];
    if (s < 0 || s >= num_src) {
      if (threadIdx.x == 0) report_fault(fault, op, m, s, num_src);
      continue;
    }
    for (int j = threadIdx.x; j < H / V; j += blockDim.x) gather_vec<In, Out, V>(rows, H, s, m, j, out);
  }
}

// out[n] (+)= sum_k w[n, k] perm[pos[n, k]], in k order, fp32.
template <typename In, typename Out, int V>
__global__ void unpermute_kernel(const In* perm, const int32_t* pos, const float* w, int64_t N, int K, int H,
                                 int64_t M, bool accumulate, Out* out, DeviceFault* fault) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x)
    for (int j = threadIdx.x; j < H / V; j += blockDim.x) {
      const int64_t bad = unpermute_vec<In, Out, V>(perm, pos, w, n, K, H, M, accumulate, j, out);
      if (bad >= 0) report_fault(fault, FaultOp::kUnpermutePairPos, bad, pos[bad], M);
    }
}

template <typename F>
void with_width(int H, std::initializer_list<const void*> ptrs, F&& f) {
  bool vec = H % kVec == 0;
  for (const void* p : ptrs) vec = vec && aligned(p);
  if (vec)
    f(std::integral_constant<int, kVec>{});
  else
    f(std::integral_constant<int, 1>{});
}

void gather(CudaExec& ex, const void* rows, DType in, int H, const int32_t* src, int64_t first, int64_t M,
            int64_t num_src, void* out, DType out_dtype, FaultOp op, const char* what) {
  if (M <= 0 || H <= 0) return;
  with_dtype(in, [&](auto in_tag) {
    with_dtype(out_dtype, [&](auto out_tag) {
      with_width(H, {rows, out}, [&](auto v) {
        using In = decltype(in_tag);
        using Out = decltype(out_tag);
        gather_kernel<In, Out, decltype(v)::value><<<row_grid(M), kRowThreads, 0, ex.stream>>>(
            static_cast<const In*>(rows), H, src, first, first + M, num_src, static_cast<Out*>(out), ex.fault, op);
      });
    });
  });
  check(cudaGetLastError(), what);
}

}  // namespace

void gather_rows(CudaExec& ex, const void* rows, DType dtype, int hidden, const int32_t* src_row, int64_t first,
                 int64_t M, int64_t num_src_rows, void* out) {
  gather(ex, rows, dtype, hidden, src_row, first, M, num_src_rows, out, dtype, FaultOp::kExpertSrcRow,
         "expert mlp gather");
}

void permute(CudaExec& ex, const PermuteConfig& cfg, const PermuteArgs& a) {
  cfg.validate();
  gather(ex, a.rows, cfg.in_dtype, cfg.hidden, a.src_row, 0, cfg.num_out_rows, cfg.num_rows, a.out, cfg.out_dtype,
         FaultOp::kPermuteSrcRow, "permute");
}

void unpermute(CudaExec& ex, const UnpermuteConfig& cfg, const UnpermuteArgs& a) {
  cfg.validate();
  const int64_t N = cfg.num_rows;
  const int H = cfg.hidden;
  if (N <= 0 || H <= 0) return;
  const int64_t M = row_logic::perm_rows(cfg);  // pair_pos at or beyond is a fault
  with_dtype(cfg.in_dtype, [&](auto in_tag) {
    with_dtype(cfg.out_dtype, [&](auto out_tag) {
      with_width(H, {a.perm, a.out}, [&](auto v) {
        using In = decltype(in_tag);
        using Out = decltype(out_tag);
        unpermute_kernel<In, Out, decltype(v)::value><<<row_grid(N), kRowThreads, 0, ex.stream>>>(
            static_cast<const In*>(a.perm), a.pair_pos, a.pair_weight, N, cfg.top_k, H, M, cfg.accumulate,
            static_cast<Out*>(a.out), ex.fault);
      });
    });
  });
  check(cudaGetLastError(), "unpermute");
}

}  // namespace moe::kernels::cuda
