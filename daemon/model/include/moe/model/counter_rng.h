// Counter-based random numbers: a value is a pure function of its key, so any
// process can rebuild any input or weight element without shared state (docs/jobs.md#inputs-and-weights).
// The mixer is the SplitMix64 finaliser applied to each key word in turn.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace moe::model {

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A key's hash starts from its length and takes its words one by one.
inline uint64_t key_start(size_t words) { return 0x6a09e667f3bcc909ull ^ words; }
inline uint64_t key_step(uint64_t h, uint64_t word) { return mix64(h + 0x9e3779b97f4a7c15ull + word); }

// Hash of an ordered key: different orders or lengths give different values.
inline uint64_t key_hash(std::initializer_list<uint64_t> words) {
  uint64_t h = key_start(words.size());
  for (uint64_t w : words) h = key_step(h, w);
  return h;
}

// Uniform in (0, 1] from 53 bits.
inline double uniform_open0(uint64_t bits) { return (static_cast<double>(bits >> 11) + 1.0) * 0x1.0p-53; }

// Standard normal for a key (Box-Muller on two derived words).
inline double normal(uint64_t key) {
  const double u1 = uniform_open0(mix64(key ^ 0x5851f42d4c957f2dull));
  const double u2 = uniform_open0(mix64(key ^ 0x14057b7ef767814full));
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586476925 * u2);
}

// key_hash({leading..., last}) for many values of `last`: the state after the
// leading words, so each key costs one mix64.
class KeyPrefix {
 public:
  explicit KeyPrefix(std::initializer_list<uint64_t> leading) : h_(key_start(leading.size() + 1)) {
    for (uint64_t w : leading) h_ = key_step(h_, w);
  }
  uint64_t hash(uint64_t last) const { return key_step(h_, last); }

 private:
  uint64_t h_;
};

// A float's bits and back (memcpy, not std::bit_cast: the CUDA tests include
// this header as C++17).
inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Two independent standard normals from a key's 64 bits (hi, lo): one Box-Muller
// draw in fp32, u1 = (hi's top 24 bits + 1) / 2^24 in (0, 1], the angle's
// quadrant from hi's low 2 bits and its fraction from lo's top 22. log, sin and
// cos are polynomials of plain IEEE float operations, branch-free: every CPU,
// and every vector width a compiler picks, gives the same bits (the file that
// calls it is built without FMA contraction). Largest |value|: sqrt(2 ln 2^24) = 5.77.
inline void box_muller_f32(uint32_t hi, uint32_t lo, float* a, float* b) {
  // ln u1 = e ln 2 + ln m, m in [sqrt(1/2), sqrt(2)): ln m = 2 atanh(s), s = (m - 1) / (m + 1),
  // |s| <= 0.172, the series to s^9 within 1e-9.
  const float u1 = static_cast<float>((hi >> 8) + 1) * 0x1.0p-24f;
  const uint32_t u1_bits = bits_of(u1);
  const bool high = (u1_bits & 0x7fffffu) > 0x3504f3u;  // mantissa above sqrt(2)
  const float m = float_of((u1_bits & 0x7fffffu) | (high ? 0x3f000000u : 0x3f800000u));
  const int32_t e = static_cast<int32_t>(u1_bits >> 23) - 127 + (high ? 1 : 0);
  const float s = (m - 1.0f) / (m + 1.0f), z = s * s;
  const float ln_m = 2.0f * s * (1.0f + z * (1.0f / 3 + z * (1.0f / 5 + z * (1.0f / 7 + z * (1.0f / 9)))));
  const float ln_u1 = static_cast<float>(e) * 0.6931471806f + ln_m;
  const float r = std::sqrt(-2.0f * ln_u1);
  // theta in [0, pi/2): Taylor series to theta^11 (sin) and theta^12 (cos), within 6e-8.
  const float t = static_cast<float>(lo >> 10) * (0x1.0p-22f * 1.5707963268f), t2 = t * t;
  const float sn = t * (1.0f + t2 * (-1.0f / 6 + t2 * (1.0f / 120 + t2 * (-1.0f / 5040 +
                                     t2 * (1.0f / 362880 + t2 * (-1.0f / 39916800))))));
  const float cs = 1.0f + t2 * (-0.5f + t2 * (1.0f / 24 + t2 * (-1.0f / 720 + t2 * (1.0f / 40320 +
                                     t2 * (-1.0f / 3628800 + t2 * (1.0f / 479001600))))));
  // The quadrant q turns (cos, sin) by q x 90 degrees.
  const uint32_t q = hi & 3u;
  const float x = (q & 1u) ? sn : cs, y = (q & 1u) ? cs : sn;
  *a = r * (((q + 1u) & 2u) ? -x : x);
  *b = r * ((q & 2u) ? -y : y);
}

}  // namespace moe::model
