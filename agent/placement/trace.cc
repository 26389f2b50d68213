#include "moe/placement/trace.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "moe/base/check.h"
#include "moe/placement/rng.h"

namespace moe::placement {

namespace {

constexpr uint64_t kWindowKey = 0xD1B54A32D192ED03ull;

// Writes into out the indices of the k smallest keys (ties: lower index).
void smallest_k(std::vector<std::pair<double, int>>& keys, int k, std::vector<int>& out) {
  auto less = [](const auto& a, const auto& b) {
    return a.first < b.first || (a.first == b.first && a.second < b.second);
  };
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), less);
  out.clear();
  for (int i = 0; i < k; ++i) out.push_back(keys[i].second);
}

}  // namespace

void TraceConfig::validate() const {
  MOE_CHECK(num_experts >= 1 && num_experts <= (1 << 20), "experts (", num_experts,
                      ") must be in [1, 1048576]");
  MOE_CHECK(top_k >= 1 && top_k <= num_experts, "top_k (", top_k,
                      ") must be in [1, experts (", num_experts, ")]");
  MOE_CHECK(num_tokens >= 0 && num_tokens <= (int64_t{1} << 26), "tokens (", num_tokens,
                      ") must be in [0, 67108864]");
  MOE_CHECK(num_tokens * top_k <= (int64_t{1} << 28), "tokens x top_k (",
                      num_tokens * top_k, ") must be at most 268435456");
  MOE_CHECK(std::isfinite(zipf_alpha) && zipf_alpha >= 0.0 && zipf_alpha <= 16.0,
                      "zipf alpha (", zipf_alpha, ") must be in [0, 16]");
  MOE_CHECK(num_groups >= 0, "groups (", num_groups, ") must not be negative");
  MOE_CHECK(num_groups <= 1 || num_experts % num_groups == 0, "experts (", num_experts,
                      ") must be divisible by groups (", num_groups, ")");
  MOE_CHECK(group_top_k >= 0, "group_top_k (", group_top_k, ") must not be negative");
  if (group_top_k > 0) {
    MOE_CHECK(num_groups > 1, "group_top_k (", group_top_k,
                        ") needs more than one group (groups = ", num_groups, ")");
    MOE_CHECK(group_top_k <= num_groups, "group_top_k (", group_top_k,
                        ") exceeds groups (", num_groups, ")");
    const int candidates = group_top_k * (num_experts / num_groups);
    MOE_CHECK(top_k <= candidates, "top_k (", top_k, ") exceeds the experts of ",
                        group_top_k, " groups (", candidates, ")");
  }
}

std::vector<double> Trace::expert_loads() const {
  std::vector<double> loads(num_experts, 0.0);
  for (int32_t e : topk_idx) loads[e] += 1.0;
  return loads;
}

std::vector<double> expert_popularity(const TraceConfig& config) {
  config.validate();
  std::vector<int> order(config.num_experts);
  std::iota(order.begin(), order.end(), 0);
  SplitMix64 rng(config.seed);
  for (int i = config.num_experts - 1; i > 0; --i)
    std::swap(order[i], order[rng.next_below(static_cast<uint64_t>(i) + 1)]);
  std::vector<double> weight(config.num_experts);
  for (int pos = 0; pos < config.num_experts; ++pos)
    weight[order[pos]] = std::pow(1.0 + pos, -config.zipf_alpha);
  return weight;
}

Trace generate_trace(const TraceConfig& config) {
  const std::vector<double> weight = expert_popularity(config);
  const int e_total = config.num_experts;
  const int k = config.top_k;
  Trace trace;
  trace.num_experts = e_total;
  trace.top_k = k;
  trace.topk_idx.reserve(static_cast<size_t>(config.num_tokens) * k);
  SplitMix64 rng(config.seed ^ (kWindowKey * (config.window + 1)));

  const bool limited = config.group_limited();
  const int num_groups = limited ? config.num_groups : 1;
  const int group_size = e_total / num_groups;
  std::vector<double> group_weight(num_groups, 0.0);
  for (int e = 0; e < e_total; ++e) group_weight[e / group_size] += weight[e];

  std::vector<std::pair<double, int>> keys;
  std::vector<int> groups, picked;
  for (int64_t t = 0; t < config.num_tokens; ++t) {
    keys.clear();
    if (limited) {
      std::vector<std::pair<double, int>> gkeys(num_groups);
      for (int g = 0; g < num_groups; ++g)
        gkeys[g] = {-std::log(rng.next_open01()) / group_weight[g], g};
      smallest_k(gkeys, config.group_top_k, groups);
      std::sort(groups.begin(), groups.end());
      for (int g : groups)
        for (int e = g * group_size; e < (g + 1) * group_size; ++e)
          keys.emplace_back(-std::log(rng.next_open01()) / weight[e], e);
    } else {
      for (int e = 0; e < e_total; ++e)
        keys.emplace_back(-std::log(rng.next_open01()) / weight[e], e);
    }
    smallest_k(keys, k, picked);
    std::sort(picked.begin(), picked.end());
    trace.topk_idx.insert(trace.topk_idx.end(), picked.begin(), picked.end());
  }
  return trace;
}

}  // namespace moe::placement
