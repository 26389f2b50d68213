// The paced weight prefetch of the few-row kernels (small_gemm.h).
#pragma once

#include <immintrin.h>

#include <cstdint>

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

}  // namespace
}  // namespace moe::kernels::cpu::detail
