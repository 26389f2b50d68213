// Capacity dropping's per-pair work, shared by capacity.cu's kernels and their
// host emulation in tests/gpu/cuda_logic_test.cu. The pairs are stably sorted by
// key = expert << 32 | order (order: the weight as descending bits for the probs
// policy, 0 for position; unselected pairs sort last as expert E); a pair whose
// rank inside its expert reaches the capacity is dropped.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "moe/kernels/types.h"

namespace moe::kernels::cuda::capacity_logic {

// Ascending order of the result = descending weight; NaN sorts as -inf (last),
// -0 as +0 (the CPU compares them equal: a tie, kept in (token, k) order).
MOE_HOST_DEVICE inline uint32_t descending_bits(float w) {
  if (w != w) w = -INFINITY;
  if (w == 0.0f) w = 0.0f;
  uint32_t u;
  memcpy(&u, &w, 4);
  const uint32_t ascending = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~ascending;
}

// The sort key of a pair of expert e (-1: none) and weight w.
MOE_HOST_DEVICE inline uint64_t pair_key(int32_t e, int E, bool by_probs, float w) {
  const uint64_t expert = e < 0 ? uint64_t(E) : uint64_t(e);
  return expert << 32 | (by_probs && e >= 0 ? descending_bits(w) : 0u);
}

MOE_HOST_DEVICE inline uint32_t key_expert(uint64_t key) { return static_cast<uint32_t>(key >> 32); }

// Sorted position i starts its expert's run: start[expert] = i.
MOE_HOST_DEVICE inline void mark_start(int64_t i, const uint64_t* keys, int32_t* start) {
  const uint32_t e = key_expert(keys[i]);
  if (i == 0 || key_expert(keys[i - 1]) != e) start[e] = static_cast<int32_t>(i);
}

// Sorted position i (pair vals[i]) is dropped when cap pairs of its expert precede it.
MOE_HOST_DEVICE inline void drop_if_over(int64_t i, int E, int64_t cap, const uint64_t* keys, const int32_t* vals,
                                         const int32_t* start, int32_t* kept) {
  const uint32_t e = key_expert(keys[i]);
  if (e < static_cast<uint32_t>(E) && i - start[e] >= cap) kept[vals[i]] = -1;
}

}  // namespace moe::kernels::cuda::capacity_logic
