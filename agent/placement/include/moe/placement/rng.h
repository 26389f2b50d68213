// SplitMix64 (Steele, Lea, Flood 2014): the fixed RNG of the trace generator.
//
// Chosen because its output is defined by a few integer operations, so a trace
// is bit-identical on every machine and compiler (std:: distributions are not).
#pragma once

#include <cstdint>

namespace moe::placement {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t next_u64() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  // Uniform in the open interval (0, 1): 53 random bits, centred in their cell.
  double next_open01() { return (static_cast<double>(next_u64() >> 11) + 0.5) * 0x1.0p-53; }

  // Uniform integer in [0, n), n > 0 (Lemire's multiply-shift; the bias for
  // n << 2^64 is far below anything a trace can show).
  uint64_t next_below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next_u64()) * n) >> 64);
  }

 private:
  uint64_t state_;
};

}  // namespace moe::placement
