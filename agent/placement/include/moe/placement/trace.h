// The pinned synthetic routing trace.
//
// Expert popularity is 1 / rank^alpha over an order shuffled by the seed
// (Fisher-Yates). Each token picks top_k distinct experts with probability
// proportional to popularity, without replacement: Gumbel top-k, computed as
// the equivalent exponential race (the top_k smallest -ln(u) / w_e). With
// groups and group_top_k > 0 a token first picks group_top_k groups the same
// way, a group's weight being the sum of its members' popularities, then its
// top_k experts among the members of those groups (group-limited routing).
// Groups are contiguous, as in PlacementSpec.
//
// RNG: SplitMix64. The popularity order comes from the stream seeded with
// `seed`; the tokens of window w from the stream seeded with
// seed ^ (0xD1B54A32D192ED03 * (w + 1)), so window 1 is a second sample of the
// same workload (what a rebalance sees one window later). Bit-reproducible.
#pragma once

#include <cstdint>
#include <vector>

namespace moe::placement {

struct TraceConfig {
  int num_experts = 256;
  int top_k = 8;
  int64_t num_tokens = 65536;
  double zipf_alpha = 1.2;
  uint64_t seed = 0;
  uint64_t window = 0;
  int num_groups = 0;   // 0 or 1: no groups
  int group_top_k = 0;  // 0: routing is not group-limited

  // Throws moe::Error naming the bad field.
  void validate() const;
  bool group_limited() const { return num_groups > 1 && group_top_k > 0; }
};

struct Trace {
  int num_experts = 0;
  int top_k = 0;
  std::vector<int32_t> topk_idx;  // [T, top_k], logical expert ids, ascending per token

  int64_t num_tokens() const {
    return top_k == 0 ? 0 : static_cast<int64_t>(topk_idx.size()) / top_k;
  }
  // Tokens per expert [E] (the per-expert load).
  std::vector<double> expert_loads() const;
};

// Popularity weight of every expert [E]: 1 / (1 + position in the shuffled order)^alpha.
std::vector<double> expert_popularity(const TraceConfig& config);

Trace generate_trace(const TraceConfig& config);

}  // namespace moe::placement
