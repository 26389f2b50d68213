// The one kernel of the NCCL transport (private to moe_transport_nccl).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace moe::transport::detail {

// out[i] = gathered[0][i] + gathered[1][i] + ... + gathered[ranks-1][i], added in
// that order with round-to-nearest adds (no reassociation), so every rank that
// sums the same gathered rows gets the same bits. gathered is [ranks, count]
// row-major, device memory; out must not overlap it. Enqueued on `stream`;
// returns the launch error.
cudaError_t launch_sum_ranks(const float* gathered, int ranks, size_t count, float* out, cudaStream_t stream);

}  // namespace moe::transport::detail
