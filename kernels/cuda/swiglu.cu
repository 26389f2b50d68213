// SwiGLU on rows of gu = [g | u]: h = scale * silu(g) * u, and its backward with
// the per-row routing-weight gradient <grad_h, silu(g) * u> (a block reduction).
#include "cuda_ops.h"

namespace moe::kernels::cuda {
namespace {

constexpr int kRowThreads = 256;

unsigned row_grid(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, int64_t{1} << 20)); }

template <typename Out>
__global__ void swiglu_forward_kernel(int64_t rows, int I, const float* gu, const float* scale, Out* h) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    const float s = scale ? scale[r] : 1.0f;
    for (int i = threadIdx.x; i < I; i += blockDim.x) h[r * I + i] = from_f32<Out>(row_logic::swiglu(g[i], u[i], s));
  }
}

__device__ float block_sum(float v) {
  __shared__ float partial[kRowThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // `partial` may still be read by the previous row's reduction
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kRowThreads / 32; ++w) total += partial[w];  // fixed order: deterministic
  return total;
}

template <typename Out>
__global__ void swiglu_backward_kernel(int64_t rows, int I, const float* gu, const float* grad_h, const float* scale,
                                       Out* grad_gu, float* grad_scale, Out* h) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    const float* dh = grad_h + r * I;
    Out* dg = grad_gu + r * 2 * I;
    Out* du = dg + I;
    const float s = scale ? scale[r] : 1.0f;
    float dot = 0.0f;
    for (int i = threadIdx.x; i < I; i += blockDim.x) {
      const row_logic::SwigluGrad d = row_logic::swiglu_grad(g[i], u[i], dh[i], s);
      dot += dh[i] * d.h;
      du[i] = from_f32<Out>(d.du);
      dg[i] = from_f32<Out>(d.dg);
      if (h) h[r * I + i] = from_f32<Out>(s * d.h);
    }
    const float total = block_sum(dot);
    if (grad_scale && threadIdx.x == 0) grad_scale[r] = total;
  }
}

}  // namespace

void swiglu_forward(CudaExec& ex, int64_t rows, int I, const float* gu, const float* row_scale, void* h,
                    DType h_dtype) {
  if (rows <= 0 || I <= 0) return;
  with_dtype(h_dtype, [&](auto tag) {
    using Out = decltype(tag);
    swiglu_forward_kernel<<<row_grid(rows), kRowThreads, 0, ex.stream>>>(rows, I, gu, row_scale, static_cast<Out*>(h));
  });
  check(cudaGetLastError(), "swiglu forward");
}

void swiglu_backward(CudaExec& ex, int64_t rows, int I, const float* gu, const float* grad_h, const float* row_scale,
                     void* grad_gu, float* grad_row_scale, void* h, DType dtype) {
  if (rows <= 0 || I <= 0) return;
  with_dtype(dtype, [&](auto tag) {
    using Out = decltype(tag);
    swiglu_backward_kernel<<<row_grid(rows), kRowThreads, 0, ex.stream>>>(
        rows, I, gu, grad_h, row_scale, static_cast<Out*>(grad_gu), grad_row_scale, static_cast<Out*>(h));
  });
  check(cudaGetLastError(), "swiglu backward");
}

}  // namespace moe::kernels::cuda
