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

// FP8 wire rows (docs/layer.md#wire-formats; DeepEP's dispatch format): a row of
// `hidden` values is `hidden` OCP e4m3 bytes (4 exponent bits, bias 7, 3 mantissa
// bits, largest 448, no infinities, NaN 0x7f) followed by one fp32 scale per group
// of 128 values (the last group may be shorter): scale = amax / 448 over the
// group in fp32 (1 for an all-zero group), byte = e4m3(x / scale), value = byte's
// e4m3 x scale. e4m3 rounds to nearest even and saturates at 448.
constexpr int kFp8GroupSize = 128;
constexpr float kFp8Max = 448.0f;
MOE_HOST_DEVICE inline int64_t fp8_groups(int hidden) { return (hidden + kFp8GroupSize - 1) / kFp8GroupSize; }
MOE_HOST_DEVICE inline size_t fp8_row_bytes(int hidden) { return static_cast<size_t>(hidden) + 4 * fp8_groups(hidden); }

MOE_HOST_DEVICE inline uint8_t f32_to_e4m3(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7f;  // NaN
  float a;
  memcpy(&a, &abs_bits, 4);
  if (a >= kFp8Max) return sign | 0x7e;  // saturate (infinities too)
  if (a < 0x1p-6f) {  // subnormal: multiples of 2^-9, to nearest even (8 is 2^-6: code 0x08)
    const float m = a * 512.0f;  // exact
    auto q = static_cast<uint32_t>(m);
    const float rest = m - static_cast<float>(q);
    if (rest > 0.5f || (rest == 0.5f && (q & 1u))) ++q;
    return sign | static_cast<uint8_t>(q);
  }
  int e = static_cast<int>(abs_bits >> 23) - 127;  // -6 .. 8
  uint32_t m = (abs_bits >> 20) & 7u;
  const uint32_t rest = abs_bits & 0xfffffu, half = 0x80000u;
  if (rest > half || (rest == half && (m & 1u))) ++m;
  if (m == 8) {
    m = 0;
    ++e;
  }
  if (e > 8 || (e == 8 && m > 6)) return sign | 0x7e;
  return sign | static_cast<uint8_t>(((e + 7) << 3) | m);
}

MOE_HOST_DEVICE inline float e4m3_to_f32(uint8_t q) {
  const int e = (q >> 3) & 0xf, m = q & 7;
  uint32_t bits;  // the value as fp32 bits: exact, every e4m3 value is an fp32 normal
  if (e == 15 && m == 7) {
    bits = 0x7fc00000u;  // quiet NaN
  } else if (e == 0) {
    const float v = static_cast<float>(m) * 0x1p-9f;
    memcpy(&bits, &v, 4);
  } else {
    bits = (static_cast<uint32_t>(e - 7 + 127) << 23) | (static_cast<uint32_t>(m) << 20);
  }
  bits |= static_cast<uint32_t>(q & 0x80u) << 24;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// Rounds an fp32 value to the nearest bf16 value, returned as fp32.
inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

}  // namespace moe::kernels
