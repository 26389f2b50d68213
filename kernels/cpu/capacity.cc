// Capacity dropping: per logical expert keep at most capacity() pairs of this
// source rank, highest weight first (probs) or lowest token first (position).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu_ops.h"
#include "moe/base/check.h"

namespace moe::kernels::cpu {

// Workspace: expert_begin [E + 1] int64, pairs [T * K] int32 (t * K + k, grouped by expert).
size_t capacity_workspace_bytes(const CapacityConfig& cfg) {
  return align64(8 * (static_cast<size_t>(cfg.num_experts) + 1)) +
         align64(4 * static_cast<size_t>(cfg.num_tokens) * cfg.top_k);
}

void capacity_drop(ThreadPool& pool, const CapacityConfig& cfg, const CapacityArgs& a) {
  cfg.validate();
  const int64_t T = cfg.num_tokens, n = T * cfg.top_k;
  const int E = cfg.num_experts;
  std::memcpy(a.kept_idx, a.topk_idx, sizeof(int32_t) * n);
  if (cfg.capacity_factor == 0.0 || T == 0) return;
  const int64_t cap = cfg.capacity();

  int64_t* begin = static_cast<int64_t*>(a.workspace);
  int32_t* pairs = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(a.workspace) +
                                              align64(8 * (static_cast<size_t>(E) + 1)));
  // Counting sort of pairs by expert, stable in (token, k) order.
  std::fill(begin, begin + E + 1, 0);
  for (int64_t p = 0; p < n; ++p) {
    const int32_t e = a.topk_idx[p];
    MOE_CHECK(e >= -1 && e < E, "capacity: topk_idx[", p, "] = ", e, " is out of range [0, ", E, ")");
    if (e >= 0) ++begin[e + 1];
  }
  for (int e = 0; e < E; ++e) begin[e + 1] += begin[e];
  {
    // Fill with a moving cursor per expert; reuse `begin` shifted by one slot.
    for (int64_t p = 0; p < n; ++p) {
      const int32_t e = a.topk_idx[p];
      if (e >= 0) pairs[begin[e]++] = static_cast<int32_t>(p);
    }
    for (int e = E; e > 0; --e) begin[e] = begin[e - 1];
    begin[0] = 0;
  }

  pool.parallel_for(E, [&](int64_t e, int) {
    int32_t* first = pairs + begin[e];
    const int64_t count = begin[e + 1] - begin[e];
    if (count <= cap) return;
    if (cfg.policy == DropPolicy::kProbs) {
      // Highest weight first; equal weights keep the lower (token, k) first. Total
      // order, so std::sort is deterministic.
      // NaN sorts as -inf: the comparator stays a strict weak order whatever the data.
      auto key = [&](int32_t p) {
        const float w = a.topk_weight[p];
        return std::isnan(w) ? -std::numeric_limits<float>::infinity() : w;
      };
      std::sort(first, first + count, [&](int32_t x, int32_t y) {
        const float wx = key(x), wy = key(y);
        if (wx != wy) return wx > wy;
        return x < y;
      });
    }
    for (int64_t i = cap; i < count; ++i) a.kept_idx[first[i]] = -1;
  });
}

}  // namespace moe::kernels::cpu
