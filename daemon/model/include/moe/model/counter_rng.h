// Counter-based random numbers: a value is a pure function of its key, so any
// process can rebuild any input or weight element without shared state (docs/jobs.md#inputs-and-weights).
// The mixer is the SplitMix64 finaliser applied to each key word in turn.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace moe::model {

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Hash of an ordered key: different orders or lengths give different values.
inline uint64_t key_hash(std::initializer_list<uint64_t> words) {
  uint64_t h = 0x6a09e667f3bcc909ull ^ words.size();
  for (uint64_t w : words) h = mix64(h + 0x9e3779b97f4a7c15ull + w);
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

// Two independent standard normals for a key: both outputs of one Box-Muller
// draw (r cos, r sin), at about half the cost per value of normal().
inline void normal_pair(uint64_t key, float* a, float* b) {
  const double u1 = uniform_open0(mix64(key ^ 0x5851f42d4c957f2dull));
  const double u2 = uniform_open0(mix64(key ^ 0x14057b7ef767814full));
  const double r = std::sqrt(-2.0 * std::log(u1)), theta = 6.283185307179586476925 * u2;
  *a = static_cast<float>(r * std::cos(theta));
  *b = static_cast<float>(r * std::sin(theta));
}

}  // namespace moe::model
