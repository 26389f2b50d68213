// What the few-row kernels (small_gemm.h) share: the paced weight prefetch, the
// row order their bf16 widening needs, and the walk over bf16 weight panels.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "moe/kernels/types.h"

namespace moe::kernels::cpu::detail {
namespace {

// The weights a block reads next, prefetched into L2 while the rows compute.
// A block of weights is read from memory by the first group of rows and from L1
// by the others, so a call's groups split the prefetch of the block kAhead on
// between them (slice), each spreading its share over its k steps (step): the
// misses stay in flight through the whole block instead of in a burst during
// the first group.
struct Prefetch {
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;

  // Group g of `groups`' share of the cache lines the `bytes` at `ahead` touch
  // (null: nothing), over `steps` k steps.
  static Prefetch slice(const void* ahead, int64_t bytes, int64_t g, int64_t groups, int64_t steps) {
    if (!ahead || bytes <= 0) return {};
    const char* first = static_cast<const char*>(ahead);
    const int64_t skew = static_cast<int64_t>(reinterpret_cast<uintptr_t>(first) % 64);
    const int64_t lines = (skew + bytes + 63) / 64, b = g * lines / groups, e = (g + 1) * lines / groups;
    const char* base = first - skew;  // the first line's start, inside the allocation's line
    steps = steps < 1 ? 1 : steps;
    return {base + b * 64, base + e * 64, (e - b + steps - 1) / steps};
  }

  void step() {
    for (int64_t l = 0; l < per_step && next < end; ++l, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

constexpr int kPanelRows = 8;          // rows of W per bf16 panel (pack_small_bf16_weights)
constexpr int64_t kPanelsAhead = 4;    // panels prefetched ahead of the one computed

// The rows of x [m, k] with each `width` values reordered evens then odds, zero
// padded to kp per row: the order in which a shift and a mask widen bf16 pairs.
inline void deinterleave(const float* x, int64_t m, int64_t k, int64_t kp, int64_t width, float* xd) {
  for (int64_t i = 0; i < m; ++i) {
    float* d = xd + i * kp;
    std::fill(d, d + kp, 0.0f);
    for (int64_t v = 0; v < k; ++v) d[v / width * width + (v % 2) * (width / 2) + (v % width) / 2] = x[i * k + v];
  }
}

// Every call a kernel makes on bf16 panels w [n rows, kp values a row]: for each
// panel (8 rows from j0, `valid` of them real), each of its `parts` and each group
// of up to mr rows of X from i, visit(j0, part, i, rows, panel, valid, pf), where
// pf is the call's share of the prefetch of the panel kPanelsAhead on, over
// `steps` k steps. The calls after a panel's first read it from L1.
template <class Visit>
void walk_panels(const bf16_t* w, int64_t n, int64_t kp, int64_t m, int64_t mr, int parts, int64_t steps,
                 Visit&& visit) {
  const int64_t groups = (m + mr - 1) / mr, calls = parts * groups;
  for (int64_t j0 = 0; j0 < n; j0 += kPanelRows) {
    const bf16_t* panel = w + j0 * kp;
    const int valid = static_cast<int>(std::min<int64_t>(kPanelRows, n - j0));
    const bf16_t* ahead =
        j0 + (kPanelsAhead + 1) * kPanelRows <= n ? panel + kPanelsAhead * kPanelRows * kp : nullptr;
    for (int part = 0; part < parts; ++part)
      for (int64_t i = 0; i < m; i += mr)
        visit(j0, part, i, std::min(mr, m - i), panel, valid,
              Prefetch::slice(ahead, kPanelRows * kp * 2, part * groups + i / mr, calls, steps));
  }
}

}  // namespace
}  // namespace moe::kernels::cpu::detail
