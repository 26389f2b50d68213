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

// Items are pairs in the layout's row order: item i is pair k = i % K of the
// row at position i / K, that row being row_order[i / K] when a row_order is
// given (a chunked layer's order, docs/layer.md#overlap), else i / K. The sort is
// stable in item order, so an expert's pairs follow their rows' positions.
// The pair (row * K + k) of item i, or -1 when row_order names no row in [0, N).
MOE_HOST_DEVICE inline int64_t pair_of_item(const PermuteParams& p, const int32_t* row_order, int64_t i) {
  if (!row_order) return i;
  const int64_t n = row_order[i / p.K];
  if (n < 0 || n >= p.N) return -1;
  return n * p.K + i % p.K;
}

// Item i: the counter it adds one to; -1 for no expert, -2 for an expert outside
// [-1, L), -3 for a row_order entry outside [0, N).
MOE_HOST_DEVICE inline int64_t permute_count_slot(const PermuteParams& p, const int32_t* row_expert,
                                                  const int32_t* row_order, int64_t i) {
  const int64_t pair = pair_of_item(p, row_order, i);
  if (pair < 0) return -3;
  const int32_t e = row_expert[pair];
  if (e < -1 || e >= p.L) return -2;
  return e < 0 ? -1 : e * p.C + i / p.K / kChunk;
}

// Item i: its pair's permuted row (pair_pos), and that row's source and weight.
MOE_HOST_DEVICE inline void permute_row(const PermuteParams& p, const PermuteLayoutArgs& a, const int64_t* bases,
                                        int64_t i) {
  const int64_t pair = pair_of_item(p, a.row_order, i);
  if (pair < 0) return;  // a fault the count reported
  const int32_t e = a.row_expert[pair];
  if (e < 0 || e >= p.L) {
    a.pair_pos[pair] = -1;
    return;
  }
  int64_t m = bases[e * p.C + i / p.K / kChunk];
  for (int64_t j = i / p.K / kChunk * kChunk * p.K; j < i; ++j) {
    const int64_t other = pair_of_item(p, a.row_order, j);
    m += other >= 0 && a.row_expert[other] == e;
  }
  a.pair_pos[pair] = static_cast<int32_t>(m);
  a.perm_src_row[m] = static_cast<int32_t>(pair / p.K);
  if (a.row_weight && a.perm_weight) a.perm_weight[m] = a.row_weight[pair];
}

}  // namespace moe::kernels::cuda::layout_logic
