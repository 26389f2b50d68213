// Plain types shared by every op: storage dtypes, routing enums, bf16 conversion.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

// Functions the CUDA kernels share with host code (replica_index) are marked
// MOE_HOST_DEVICE: __host__ __device__ under nvcc, nothing elsewhere.
#if defined(__CUDACC__)
#define MOE_HOST_DEVICE __host__ __device__
#else
#define MOE_HOST_DEVICE
#endif

namespace moe::kernels {

// Storage dtype of activations and weights. Accumulation is always fp32.
enum class DType : uint8_t { kF32, kBF16 };
enum class ScoreFunc : uint8_t { kSoftmax, kSigmoid };
// Capacity drop order: kProbs keeps the highest routing weight first, kPosition the
// lowest token index first. Ties go to the lower token index in both.
enum class DropPolicy : uint8_t { kProbs, kPosition };

// How tokens choose experts (docs/layer.md#router): the one description of routing that
// the layer config, the router op's config and the fp64 reference's config
// share (each derives from it). Group-limited routing when num_groups > 1.
struct RoutingParams {
  int num_experts = 0;  // E logical experts
  int top_k = 0;        // K
  ScoreFunc score = ScoreFunc::kSoftmax;
  int num_groups = 0;  // 0 or 1: no group limit
  int group_top_k = 0;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;

  // Throws moe::Error naming the field (prefixed by `who`, e.g. "router").
  void validate(const char* who) const;
  bool group_limited() const { return num_groups > 1; }
  const RoutingParams& routing() const { return *this; }
};

inline size_t dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }
const char* dtype_name(DType t);            // "fp32" | "bf16"
DType parse_dtype(std::string_view s);      // throws moe::Error naming s
const char* score_name(ScoreFunc s);        // "softmax" | "sigmoid"
ScoreFunc parse_score(std::string_view s);
const char* drop_policy_name(DropPolicy p);  // "probs" | "position"
DropPolicy parse_drop_policy(std::string_view s);

// bf16 is the upper half of an IEEE fp32. Conversion rounds to nearest even;
// NaN stays NaN (quiet).
using bf16_t = uint16_t;

inline float bf16_to_f32(bf16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline bf16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0)
    return static_cast<bf16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16_t>(bits >> 16);
}

// Rounds an fp32 value to the nearest bf16 value, returned as fp32.
inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

}  // namespace moe::kernels
