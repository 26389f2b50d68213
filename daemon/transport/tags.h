// Message tags of the communicators built on tag matching (UCX, and the
// in-process LocalHub): kind (8 bits) | sequence (40 bits) | source rank (16 bits).
// Every receive matches the full tag, so messages of different operations never
// mix. Private to daemon/transport.
#pragma once

#include <cstdint>

namespace moe::transport {

enum class TagKind : uint64_t {
  kWireup = 1,
  kAllToAll = 2,
  kBarrier = 3,
  kReduce = 4,
  kBroadcast = 5,
  kP2P = 6,
  kAbort = 7,
  kBackground = 8
};

inline uint64_t make_tag(TagKind kind, uint64_t seq, int src) {
  return static_cast<uint64_t>(kind) << 56 | (seq & ((uint64_t{1} << 40) - 1)) << 16 | static_cast<uint64_t>(src);
}

}  // namespace moe::transport
