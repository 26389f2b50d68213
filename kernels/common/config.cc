// Validation of the op configs, the enum names and the optimizer's constants:
// shared by every backend.
#include <cmath>

#include "moe/kernels/api.h"
#include "moe/base/check.h"

namespace moe::kernels {

// Every enum's name is an exhaustive switch: a new value fails to compile
// (-Werror=switch) until it has a name here.
const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "fp32";
    case DType::kBF16: return "bf16";
  }
  detail::fail("dtype: invalid value ", static_cast<int>(t));
}

DType parse_dtype(std::string_view s) {
  if (s == "fp32" || s == "f32" || s == "F32") return DType::kF32;
  if (s == "bf16" || s == "BF16") return DType::kBF16;
  detail::fail("dtype: unknown value '", s, "' (expected fp32 or bf16)");
}

const char* score_name(ScoreFunc s) {
  switch (s) {
    case ScoreFunc::kSoftmax: return "softmax";
    case ScoreFunc::kSigmoid: return "sigmoid";
  }
  detail::fail("score: invalid value ", static_cast<int>(s));
}

ScoreFunc parse_score(std::string_view s) {
  if (s == "softmax") return ScoreFunc::kSoftmax;
  if (s == "sigmoid") return ScoreFunc::kSigmoid;
  detail::fail("score: unknown value '", s, "' (expected softmax or sigmoid)");
}

const char* drop_policy_name(DropPolicy p) {
  switch (p) {
    case DropPolicy::kProbs: return "probs";
    case DropPolicy::kPosition: return "position";
  }
  detail::fail("drop_policy: invalid value ", static_cast<int>(p));
}

DropPolicy parse_drop_policy(std::string_view s) {
  if (s == "probs") return DropPolicy::kProbs;
  if (s == "position") return DropPolicy::kPosition;
  detail::fail("drop_policy: unknown value '", s, "' (expected probs or position)");
}

void RoutingParams::validate(const char* who) const {
  MOE_CHECK(num_experts > 0, who, ": num_experts must be > 0, got ", num_experts);
  MOE_CHECK(top_k >= 1 && top_k <= num_experts, who, ": top_k must be in [1, num_experts=", num_experts, "], got ",
            top_k);
  MOE_CHECK(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0, who,
            ": routed_scaling_factor must be finite and > 0, got ", routed_scaling_factor);
  MOE_CHECK(num_groups >= 0, who, ": num_groups must be >= 0, got ", num_groups);
  if (group_limited()) {
    MOE_CHECK(num_experts % num_groups == 0, who, ": num_experts (", num_experts,
              ") must be divisible by num_groups (", num_groups, ")");
    MOE_CHECK(group_top_k >= 1 && group_top_k <= num_groups, who, ": group_top_k must be in [1, num_groups=",
              num_groups, "], got ", group_top_k);
    const int per_group = num_experts / num_groups;
    MOE_CHECK(top_k <= group_top_k * per_group, who, ": top_k (", top_k,
              ") exceeds the experts in the kept groups (group_top_k ", group_top_k, " x ", per_group, ")");
  }
}

void RouterConfig::validate() const {
  MOE_CHECK(num_tokens >= 0, "router: num_tokens must be >= 0, got ", num_tokens);
  MOE_CHECK(hidden > 0, "router: hidden must be > 0, got ", hidden);
  RoutingParams::validate("router");
}

void CapacityConfig::validate() const {
  MOE_CHECK(num_tokens >= 0, "capacity: num_tokens must be >= 0, got ", num_tokens);
  MOE_CHECK(num_experts > 0, "capacity: num_experts must be > 0, got ", num_experts);
  MOE_CHECK(top_k >= 1 && top_k <= num_experts, "capacity: top_k must be in [1, ", num_experts,
            "], got ", top_k);
  MOE_CHECK(std::isfinite(capacity_factor) && capacity_factor >= 0,
            "capacity_factor must be finite and >= 0, got ", capacity_factor);
}

int64_t CapacityConfig::capacity() const {
  const double v = capacity_factor * static_cast<double>(num_tokens) * top_k / num_experts;
  const double f = std::floor(v);
  if (v - f <= 1e-9 * std::max(1.0, v)) return static_cast<int64_t>(f);
  return static_cast<int64_t>(f) + 1;
}

void DispatchLayoutConfig::validate() const {
  MOE_CHECK(num_tokens >= 0, "dispatch layout: num_tokens must be >= 0, got ", num_tokens);
  MOE_CHECK(top_k >= 1, "dispatch layout: top_k must be >= 1, got ", top_k);
  MOE_CHECK(num_ranks >= 1, "dispatch layout: num_ranks must be >= 1, got ", num_ranks);
  MOE_CHECK(slots_per_rank >= 1, "dispatch layout: slots_per_rank must be >= 1, got ",
            slots_per_rank);
  MOE_CHECK(num_tokens * num_ranks <= INT32_MAX, "dispatch layout: num_tokens x num_ranks (",
            num_tokens * num_ranks, ") exceeds the int32 row index range");
}

void PermuteLayoutConfig::validate() const {
  MOE_CHECK(num_rows >= 0, "permute layout: num_rows must be >= 0, got ", num_rows);
  MOE_CHECK(top_k >= 1, "permute layout: top_k must be >= 1, got ", top_k);
  MOE_CHECK(num_experts >= 0, "permute layout: num_experts must be >= 0, got ", num_experts);
  MOE_CHECK(num_rows * top_k <= INT32_MAX, "permute layout: num_rows x top_k (",
            num_rows * top_k, ") exceeds the int32 row index range");
}

void PermuteConfig::validate() const {
  MOE_CHECK(num_rows >= 0 && num_out_rows >= 0, "permute: row counts must be >= 0 (",
            num_rows, ", ", num_out_rows, ")");
  MOE_CHECK(hidden > 0, "permute: hidden must be > 0, got ", hidden);
  MOE_CHECK(top_k >= 1, "permute: top_k must be >= 1, got ", top_k);
}

void UnpermuteConfig::validate() const {
  MOE_CHECK(num_rows >= 0, "unpermute: num_rows must be >= 0, got ", num_rows);
  MOE_CHECK(top_k >= 1, "unpermute: top_k must be >= 1, got ", top_k);
  MOE_CHECK(hidden > 0, "unpermute: hidden must be > 0, got ", hidden);
  MOE_CHECK(!accumulate || out_dtype == DType::kF32,
            "unpermute: accumulate needs an fp32 output");
  MOE_CHECK(num_perm_rows >= -1, "unpermute: num_perm_rows must be >= 0 (or -1: num_rows * top_k), got ",
            num_perm_rows);
}

void SwigluConfig::validate() const {
  MOE_CHECK(num_rows >= 0, "swiglu: num_rows must be >= 0, got ", num_rows);
  MOE_CHECK(ffn_hidden > 0, "swiglu: ffn_hidden must be > 0, got ", ffn_hidden);
}

void GroupedGemmConfig::validate() const {
  MOE_CHECK(num_groups >= 0, "grouped gemm: num_groups must be >= 0, got ", num_groups);
  MOE_CHECK(n > 0 && k > 0, "grouped gemm: n and k must be > 0, got n=", n, " k=", k);
}

void OptimizerConfig::validate() const {
  MOE_CHECK(std::isfinite(lr) && lr > 0, "optimizer: lr must be finite and > 0, got ", lr);
  MOE_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "optimizer: betas must be in [0, 1)");
  MOE_CHECK(eps > 0, "optimizer: eps must be > 0, got ", eps);
  MOE_CHECK(moments == DType::kF32 || moments == DType::kBF16, "optimizer: moments must be fp32 or bf16, got dtype ",
            static_cast<int>(moments));
}

void ExpertMlpConfig::validate() const {
  MOE_CHECK(num_experts >= 0, "expert mlp: num_experts must be >= 0, got ", num_experts);
  MOE_CHECK(hidden > 0, "expert mlp: hidden must be > 0, got ", hidden);
  MOE_CHECK(ffn_hidden > 0, "expert mlp: ffn_hidden must be > 0, got ", ffn_hidden);
  MOE_CHECK(max_rows >= 0 && max_src_rows >= 0, "expert mlp: max_rows must be >= 0");
}

void ExpertMlpConfig::check_offsets(const int64_t* off) const {
  MOE_CHECK(off[0] == 0, "expert mlp: expert_offset[0] must be 0, got ", off[0]);
  for (int e = 0; e < num_experts; ++e)
    MOE_CHECK(off[e + 1] >= off[e], "expert mlp: expert_offset decreases at expert ", e);
  MOE_CHECK(off[num_experts] <= max_rows, "expert mlp: ", off[num_experts], " permuted rows exceed max_rows (",
            max_rows, ")");
}

void ExpertMlpConfig::check_part(const int64_t* off, const int64_t* begin, const int64_t* end) const {
  MOE_CHECK(begin && end, "expert mlp: a part needs both pair_begin and pair_end");
  for (int e = 0; e < num_experts; ++e)
    MOE_CHECK(off[e] <= begin[e] && begin[e] <= end[e] && end[e] <= off[e + 1], "expert mlp: the part's pairs [",
              begin[e], ", ", end[e], ") of expert ", e, " leave its range [", off[e], ", ", off[e + 1], ")");
}

AdamConstants adam_constants(const OptimizerConfig& cfg, int64_t step) {
  const double t = static_cast<double>(step);
  const double c1 = 1.0 - std::pow(static_cast<double>(cfg.beta1), t);
  const double c2 = 1.0 - std::pow(static_cast<double>(cfg.beta2), t);
  return {cfg.beta1,
          1.0f - cfg.beta1,
          cfg.beta2,
          1.0f - cfg.beta2,
          static_cast<float>(cfg.lr / c1),
          static_cast<float>(1.0 / std::sqrt(c2)),
          cfg.eps};
}

}  // namespace moe::kernels
