// Capacity dropping on the GPU: one stable radix sort of the (token, k) pairs by
// (expert, drop order), then each pair's rank inside its expert decides. The sort
// key is expert << 32 | order, order being the weight mapped to descending
// unsigned bits (probs) or 0 (position); a stable sort keeps (token, k) order
// among equal keys, which is the CPU backend's tie rule.
#include <cub/device/device_radix_sort.cuh>

#include "cuda_ops.h"
#include "capacity_logic.cuh"
#include "moe/base/check.h"

namespace moe::kernels::cuda {
namespace {

struct CapacityWorkspace {
  uint64_t *keys_in, *keys_out;
  int32_t *vals_in, *vals_out;
  int32_t* expert_start;  // [E + 1]: first sorted position of each expert
  void* temp;
  size_t temp_bytes;
};

size_t sort_temp_bytes(int64_t n) {
  size_t bytes = 0;
  check(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint64_t*>(nullptr),
                                        static_cast<uint64_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                        static_cast<int32_t*>(nullptr), static_cast<int>(n)),
        "capacity sort size");
  return bytes;
}

CapacityWorkspace carve(const CapacityConfig& cfg, void* ws) {
  const size_t n = static_cast<size_t>(cfg.num_tokens) * cfg.top_k;
  auto* p = static_cast<uint8_t*>(ws);
  CapacityWorkspace w;
  w.keys_in = reinterpret_cast<uint64_t*>(p);
  p += align256(8 * n);
  w.keys_out = reinterpret_cast<uint64_t*>(p);
  p += align256(8 * n);
  w.vals_in = reinterpret_cast<int32_t*>(p);
  p += align256(4 * n);
  w.vals_out = reinterpret_cast<int32_t*>(p);
  p += align256(4 * n);
  w.expert_start = reinterpret_cast<int32_t*>(p);
  p += align256(4 * (static_cast<size_t>(cfg.num_experts) + 1));
  w.temp = p;
  w.temp_bytes = sort_temp_bytes(static_cast<int64_t>(n));
  return w;
}

using namespace capacity_logic;

__global__ void make_keys(int64_t n, int E, bool by_probs, const int32_t* idx, const float* w, uint64_t* keys,
                          int32_t* vals, DeviceFault* fault) {
  const int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (p >= n) return;
  int32_t e = idx[p];
  if (e < -1 || e >= E) {
    report_fault(fault, FaultOp::kCapacityExpert, p, e, E);
    e = -1;
  }
  keys[p] = pair_key(e, E, by_probs, w[p]);
  vals[p] = static_cast<int32_t>(p);
}

__global__ void mark_starts(int64_t n, const uint64_t* keys, int32_t* start) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) mark_start(i, keys, start);
}

__global__ void drop_over_capacity(int64_t n, int E, int64_t cap, const uint64_t* keys, const int32_t* vals,
                                   const int32_t* start, int32_t* kept) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) drop_if_over(i, E, cap, keys, vals, start, kept);
}

int end_bit(int E) {
  int bits = 1;
  while ((int64_t{1} << bits) <= E) ++bits;
  return 32 + bits;
}

}  // namespace

size_t capacity_workspace_bytes(const CapacityConfig& cfg) {
  const size_t n = static_cast<size_t>(cfg.num_tokens) * cfg.top_k;
  return 2 * align256(8 * n) + 2 * align256(4 * n) + align256(4 * (static_cast<size_t>(cfg.num_experts) + 1)) +
         sort_temp_bytes(static_cast<int64_t>(n));
}

void capacity_drop(CudaExec& ex, const CapacityConfig& cfg, const CapacityArgs& a) {
  cfg.validate();
  const int64_t T = cfg.num_tokens, n = T * cfg.top_k;
  const int E = cfg.num_experts;
  if (n == 0) return;
  check(cudaMemcpyAsync(a.kept_idx, a.topk_idx, 4 * n, cudaMemcpyDeviceToDevice, ex.stream), "capacity");
  if (cfg.capacity_factor == 0.0) return;
  MOE_CHECK(n < (int64_t{1} << 31), "capacity: ", n, " pairs exceed the sort's int range");
  const CapacityWorkspace w = carve(cfg, a.workspace);
  make_keys<<<blocks_for(n), kThreads, 0, ex.stream>>>(n, E, cfg.policy == DropPolicy::kProbs, a.topk_idx,
                                                       a.topk_weight, w.keys_in, w.vals_in, ex.fault);
  check(cudaGetLastError(), "capacity keys");
  size_t temp = w.temp_bytes;
  check(cub::DeviceRadixSort::SortPairs(w.temp, temp, w.keys_in, w.keys_out, w.vals_in, w.vals_out,
                                        static_cast<int>(n), 0, end_bit(E), ex.stream),
        "capacity sort");
  mark_starts<<<blocks_for(n), kThreads, 0, ex.stream>>>(n, w.keys_out, w.expert_start);
  drop_over_capacity<<<blocks_for(n), kThreads, 0, ex.stream>>>(n, E, cfg.capacity(), w.keys_out, w.vals_out,
                                                                w.expert_start, a.kept_idx);
  check(cudaGetLastError(), "capacity drop");
}

}  // namespace moe::kernels::cuda
