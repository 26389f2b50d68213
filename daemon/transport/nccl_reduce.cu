#include <algorithm>

#include "nccl_reduce.h"

namespace moe::transport::detail {
namespace {

// Grid-stride loop over elements; each thread sums its elements over the ranks.
__global__ void sum_ranks_kernel(const float* __restrict__ gathered, int ranks, size_t count,
                                 float* __restrict__ out) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    float acc = gathered[i];
    for (int r = 1; r < ranks; ++r) acc = __fadd_rn(acc, gathered[static_cast<size_t>(r) * count + i]);
    out[i] = acc;
  }
}

}  // namespace

cudaError_t launch_sum_ranks(const float* gathered, int ranks, size_t count, float* out, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  constexpr size_t kMaxBlocks = size_t{1} << 16;  // the loop covers the rest
  const size_t blocks = std::min((count + kThreads - 1) / kThreads, kMaxBlocks);
  sum_ranks_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(gathered, ranks, count, out);
  return cudaGetLastError();
}

}  // namespace moe::transport::detail
