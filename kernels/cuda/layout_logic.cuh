// The layouts' per-item work, shared by the CUDA kernels of layout.cu (one thread
// per item) and by their host emulation in tests/gpu/cuda_logic_test.cu. Both
// layouts are counting sorts over chunks of kChunk tokens (rows): count per
// (bucket, chunk), scan bucket-major, then each item's position is its chunk's
// base plus the items of its bucket before it inside the chunk.
#pragma once

#include <cstdint>

#include "moe/kernels/api.h"

namespace moe::kernels::cuda::layout_logic {

constexpr int64_t kChunk = 32;

// The first bad value an item met (position -1: none).
struct ItemFault {
  int64_t position = -1, value = 0;
};

// ---------------------------------------------------------------------------
// Dispatch layout: buckets are ranks.

struct DispatchParams {
  int64_t T;
  int K, R, S;
  int64_t C;  // chunks
};

// Token t: its is_token_in_rank row, and add(counter) for the pairs per slot and
// for its chunk's count of every rank it goes to (an atomic add on the device).
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <typename Add>
MOE_HOST_DEVICE ItemFault dispatch_count_token(const DispatchParams& p, const DispatchLayoutArgs& a, int64_t t,
                                               int32_t* counts, Add add) {
  ItemFault fault;
  const int64_t slots = int64_t{p.R} * p.S;
  uint8_t* in_rank = a.is_token_in_rank + t * p.R;
  for (int r = 0; r < p.R; ++r) in_rank[r] = 0;
  for (int k = 0; k < p.K; ++k) {
    const int32_t slot = a.topk_slot[t * p.K + k];
    if (slot < 0) continue;
    if (slot >= slots) {
      fault = {t * p.K + k, slot};
      continue;
    }
    add(&a.num_tokens_per_slot[slot]);
    in_rank[slot / p.S] = 1;
  }
  for (int r = 0; r < p.R; ++r)
    if (in_rank[r]) add(&counts[r * p.C + t / kChunk]);
  return fault;
}

// Item i = (token t, rank r): its send row (or -1) and the row's metadata.
MOE_HOST_DEVICE inline void dispatch_row(const DispatchParams& p, const DispatchLayoutArgs& a, const int64_t* bases,
                                         int64_t i) {
  const int64_t t = i / p.R;
  const int r = static_cast<int>(i % p.R);
  if (!a.is_token_in_rank[i]) {
    a.token_send_row[i] = -1;
    return;
  }
  int64_t row = bases[r * p.C + t / kChunk];
  for (int64_t u = t / kChunk * kChunk; u < t; ++u) row += a.is_token_in_rank[u * p.R + r];
  a.token_send_row[i] = static_cast<int32_t>(row);
  if (a.send_src_token) a.send_src_token[row] = static_cast<int32_t>(t);
  if (!a.send_slot) return;
  for (int k = 0; k < p.K; ++k) {
    const int32_t slot = a.topk_slot[t * p.K + k];
    const bool here = slot >= 0 && slot < int64_t{p.R} * p.S && slot / p.S == r;
    a.send_slot[row * p.K + k] = here ? slot % p.S : -1;
    if (a.send_weight) a.send_weight[row * p.K + k] = here ? a.topk_weight[t * p.K + k] : 0.0f;
  }
}

// ---------------------------------------------------------------------------
// Permute layout: buckets are local experts.

struct PermuteParams {
  int64_t N;
  int K, L;
  int64_t C;  // chunks
};

// Pair i = (row n, k): the counter it adds one to, -1 for no expert, or -2 for an
// expert outside [-1, L).
MOE_HOST_DEVICE inline int64_t permute_count_slot(const PermuteParams& p, const int32_t* row_expert, int64_t i) {
  const int32_t e = row_expert[i];
  if (e < -1 || e >= p.L) return -2;
  return e < 0 ? -1 : e * p.C + i / p.K / kChunk;
}

// Pair i: its permuted row (pair_pos), and that row's source and weight.
MOE_HOST_DEVICE inline void permute_row(const PermuteParams& p, const PermuteLayoutArgs& a, const int64_t* bases,
                                        int64_t i) {
  const int32_t e = a.row_expert[i];
  if (e < 0 || e >= p.L) {
    a.pair_pos[i] = -1;
    return;
  }
  const int64_t n = i / p.K;
  int64_t m = bases[e * p.C + n / kChunk];
  for (int64_t j = n / kChunk * kChunk * p.K; j < i; ++j) m += a.row_expert[j] == e;
  a.pair_pos[i] = static_cast<int32_t>(m);
  a.perm_src_row[m] = static_cast<int32_t>(n);
  if (a.row_weight && a.perm_weight) a.perm_weight[m] = a.row_weight[i];
}

}  // namespace moe::kernels::cuda::layout_logic
