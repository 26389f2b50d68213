// Log-spaced latency buckets that processes merge by adding counts: a serving
// job's call latencies, counted per node by the daemon and summed over nodes by
// the agent (docs/serving.md#statistics). Bucket i holds latencies in
// (bound(i-1), bound(i)] ms, bound(i) = 0.01 x 2^(i/8): 9% apart, 10 us to 335 s.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace moe {

constexpr int kLatencyBuckets = 200;

inline double latency_bucket_bound_ms(int bucket) { return 0.01 * std::exp2(bucket / 8.0); }

inline int latency_bucket(double ms) {
  if (!(ms > 0.01)) return 0;
  const int b = static_cast<int>(std::ceil(8.0 * std::log2(ms / 0.01) - 1e-9));
  return b < kLatencyBuckets ? b : kLatencyBuckets - 1;
}

// The q-quantile (0 < q <= 1) of counted latencies, as its bucket's upper bound; 0 if none.
inline double latency_quantile_ms(const std::vector<int64_t>& counts, double q) {
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  if (total == 0) return 0;
  const double want = q * static_cast<double>(total);
  int64_t seen = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    seen += counts[i];
    if (static_cast<double>(seen) >= want) return latency_bucket_bound_ms(static_cast<int>(i));
  }
  return latency_bucket_bound_ms(static_cast<int>(counts.size()) - 1);
}

}  // namespace moe
