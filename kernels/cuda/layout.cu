// Dispatch layout (which ranks need which token) and permute layout (rows to
// expert-major order) on the GPU. Both are counting sorts over fixed chunks of
// kChunk tokens (rows):
//   1. count per (bucket, chunk) with atomics (counts do not depend on order);
//   2. one exclusive scan over the counts laid out bucket-major, chunk-minor,
//      which is exactly the output order (bucket, then token order);
//   3. each item's position = its chunk's base + the items of the same bucket
//      before it inside the chunk (a short scan of at most kChunk tokens).
// The result is deterministic and equal to the CPU backend's.
#include <cub/device/device_scan.cuh>

#include "cuda_ops.h"
#include "layout_logic.cuh"
#include "moe/base/check.h"

namespace moe::kernels::cuda {
namespace {

using namespace layout_logic;

int64_t chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

size_t scan_temp_bytes(int64_t items) {
  size_t bytes = 0;
  check(cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                      static_cast<int64_t*>(nullptr), static_cast<int>(items)),
        "layout scan size");
  return bytes;
}

// Counts [buckets * C + 1] int32 (the last one stays 0 so the scan yields the
// total), bases [buckets * C + 1] int64, offsets [buckets + 1] int64, scan temp.
struct LayoutWorkspace {
  int32_t* counts;
  int64_t* bases;
  int64_t* offsets;
  void* temp;
  size_t temp_bytes;
  int64_t items;  // buckets * C + 1
};

size_t layout_bytes(int64_t buckets, int64_t n) {
  const int64_t items = buckets * chunks(n) + 1;
  return align256(4 * items) + align256(8 * items) + align256(8 * (buckets + 1)) + scan_temp_bytes(items);
}

LayoutWorkspace carve(int64_t buckets, int64_t n, void* ws) {
  LayoutWorkspace w;
  w.items = buckets * chunks(n) + 1;
  auto* p = static_cast<uint8_t*>(ws);
  w.counts = reinterpret_cast<int32_t*>(p);
  p += align256(4 * w.items);
  w.bases = reinterpret_cast<int64_t*>(p);
  p += align256(8 * w.items);
  w.offsets = reinterpret_cast<int64_t*>(p);
  p += align256(8 * (buckets + 1));
  w.temp = p;
  w.temp_bytes = scan_temp_bytes(w.items);
  return w;
}

// offsets[b] = the first output position of bucket b (b = buckets: the total).
__global__ void bucket_offsets(int64_t buckets, int64_t C, const int64_t* bases, int64_t* offsets) {
  const int64_t b = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (b <= buckets) offsets[b] = bases[b * C];
}

// Step 2: the exclusive scan of the counts into the chunks' bases.
void scan_counts(CudaExec& ex, const LayoutWorkspace& w, const char* what) {
  size_t temp = w.temp_bytes;
  check(cub::DeviceScan::ExclusiveSum(w.temp, temp, w.counts, w.bases, static_cast<int>(w.items), ex.stream), what);
}

// The buckets' first positions and the total to `host` [buckets + 1], once the
// stream reached them: the layout's one sync (it also reports kernel faults).
void publish_offsets(CudaExec& ex, const LayoutWorkspace& w, int64_t buckets, int64_t C, int64_t* host,
                     const char* what) {
  bucket_offsets<<<blocks_for(buckets + 1), kThreads, 0, ex.stream>>>(buckets, C, w.bases, w.offsets);
  check(cudaGetLastError(), what);
  check(cudaMemcpyAsync(host, w.offsets, 8 * (static_cast<size_t>(buckets) + 1), cudaMemcpyDeviceToHost, ex.stream),
        what);
  ex.sync(what);
}

// ---------------------------------------------------------------------------
// Dispatch layout. Buckets are ranks.

__global__ void dispatch_count(DispatchParams p, DispatchLayoutArgs a, int32_t* counts, DeviceFault* fault) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t >= p.T) return;
  const ItemFault f = dispatch_count_token(p, a, t, counts, [](int32_t* c) { atomicAdd(c, 1); });
  if (f.position >= 0) report_fault(fault, FaultOp::kDispatchSlot, f.position, f.value, int64_t{p.R} * p.S);
}

__global__ void rank_totals(int R, int64_t C, const int64_t* bases, int32_t* per_rank) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < R) per_rank[r] = static_cast<int32_t>(bases[(r + 1) * C] - bases[r * C]);
}

// One thread per (token, rank).
__global__ void dispatch_rows(DispatchParams p, DispatchLayoutArgs a, const int64_t* bases) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < p.T * p.R) dispatch_row(p, a, bases, i);
}

// ---------------------------------------------------------------------------
// Permute layout. Buckets are local experts.

__global__ void permute_count(PermuteParams p, const int32_t* row_expert, const int32_t* row_order, int32_t* counts,
                              DeviceFault* fault) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= p.N * p.K) return;
  const int64_t c = permute_count_slot(p, row_expert, row_order, i);
  if (c == -3 && i % p.K == 0) report_fault(fault, FaultOp::kPermuteLayoutRowOrder, i / p.K, row_order[i / p.K], p.N);
  if (c == -2) {
    const int64_t pair = pair_of_item(p, row_order, i);
    report_fault(fault, FaultOp::kPermuteLayoutExpert, pair, row_expert[pair], p.L);
  }
  if (c >= 0) atomicAdd(&counts[c], 1);
}

// One thread per item (a (row, k) pair in the layout's row order).
__global__ void permute_rows(PermuteParams p, PermuteLayoutArgs a, const int64_t* bases) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < p.N * p.K) permute_row(p, a, bases, i);
}

}  // namespace

size_t dispatch_layout_workspace_bytes(const DispatchLayoutConfig& cfg) {
  return layout_bytes(cfg.num_ranks, cfg.num_tokens);
}

void dispatch_layout(CudaExec& ex, const DispatchLayoutConfig& cfg, const DispatchLayoutArgs& a) {
  cfg.validate();
  const int64_t T = cfg.num_tokens;
  const int R = cfg.num_ranks;
  const DispatchParams p{T, cfg.top_k, R, cfg.slots_per_rank, chunks(T)};
  const LayoutWorkspace w = carve(R, T, a.workspace);
  check(cudaMemsetAsync(w.counts, 0, 4 * w.items, ex.stream), "dispatch layout");
  check(cudaMemsetAsync(a.num_tokens_per_slot, 0, 4 * static_cast<size_t>(R) * cfg.slots_per_rank, ex.stream),
        "dispatch layout");
  if (T > 0) dispatch_count<<<blocks_for(T), kThreads, 0, ex.stream>>>(p, a, w.counts, ex.fault);
  check(cudaGetLastError(), "dispatch layout count");
  scan_counts(ex, w, "dispatch layout scan");
  rank_totals<<<blocks_for(R), kThreads, 0, ex.stream>>>(R, p.C, w.bases, a.num_tokens_per_rank);
  if (T > 0) dispatch_rows<<<blocks_for(T * R), kThreads, 0, ex.stream>>>(p, a, w.bases);
  check(cudaGetLastError(), "dispatch layout rows");
  publish_offsets(ex, w, R, p.C, a.rank_offset, "dispatch layout");
}

size_t permute_layout_workspace_bytes(const PermuteLayoutConfig& cfg) {
  return layout_bytes(cfg.num_experts, cfg.num_rows);
}

void permute_layout(CudaExec& ex, const PermuteLayoutConfig& cfg, const PermuteLayoutArgs& a) {
  cfg.validate();
  const int64_t N = cfg.num_rows;
  const int L = cfg.num_experts;
  const PermuteParams p{N, cfg.top_k, L, chunks(N)};
  const LayoutWorkspace w = carve(L, N, a.workspace);
  check(cudaMemsetAsync(w.counts, 0, 4 * w.items, ex.stream), "permute layout");
  if (N > 0) {
    permute_count<<<blocks_for(N * p.K), kThreads, 0, ex.stream>>>(p, a.row_expert, a.row_order, w.counts,
                                                                    ex.fault);
    check(cudaGetLastError(), "permute layout count");
  }
  scan_counts(ex, w, "permute layout scan");
  if (N > 0) {
    permute_rows<<<blocks_for(N * p.K), kThreads, 0, ex.stream>>>(p, a, w.bases);
    check(cudaGetLastError(), "permute layout rows");
  }
  publish_offsets(ex, w, L, p.C, a.expert_offset, "permute layout");
}

}  // namespace moe::kernels::cuda
