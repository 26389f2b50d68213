// The expert service's data path for large tensors (docs/serving.md#data-path):
// a UCX worker on a thread of its own that moves sealed messages between a
// program and the nodes of a serving job. The control-plane call (mutual TLS,
// the token) says what a call is; its rows travel here. Each message is sealed:
// it carries the GMAC (AES-256-GCM over the bytes, nothing encrypted) under the
// key the two sides agreed on a control-plane call (ServeOpenWire), with a nonce
// made from its tag, so a forged, altered or misdirected message fails to open
// and is dropped. The rows are not encrypted, as the data plane's are not: a
// caller whose rows must stay secret on the network keeps them in the call
// (docs/serving.md#data-path says why: speed).
//
// Tags: direction (8 bits) | the receiver's id for the sender (24) | sequence (32).
// The sender picks the sequence, once per message under a key.
//
// Every message that arrives is taken off UCX's queue at once: one from a peer
// the port does not know, of the wrong direction, over the peer's size limit, or
// beyond its unclaimed bytes is dropped unread; one that opens waits to be
// claimed (expect) for kUnclaimed at most. So a stranger on the network can
// make the port drop messages, not hold memory.
//
// Thread-safe: every call may come from any thread; UCX runs on the port's thread.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace moe::tensor_wire {

using Key = std::array<uint8_t, 32>;
Key new_key();  // from OpenSSL's CSPRNG

// How a node begins its refusal of a call that names a wire peer it does not
// have (a restarted node, or a session whose connections all closed): the
// client opens the wire again and sends the call again.
constexpr const char* kNoWire = "no tensor wire";

enum class Direction : uint8_t { kToNode = 1, kToClient = 2 };
constexpr uint32_t kMaxPeerId = (1u << 24) - 1;
uint64_t make_tag(Direction direction, uint32_t receiver_peer, uint32_t seq);

// The bytes and their GMAC (AES-256-GCM, the tag as nonce): `n` bytes -> n +
// kSealBytes. open() checks in place (shrinking the message to the bytes);
// false when the message was not sealed under this key and tag, or was altered.
constexpr size_t kSealBytes = 16;
std::string seal(const Key& key, uint64_t tag, const void* plain, size_t n);
bool open(const Key& key, uint64_t tag, std::string& message);

struct PortOptions {
  Direction receives = Direction::kToNode;  // what this side accepts
  // Let UCX use shared memory between processes of one host (sets
  // UCX_MM_ERROR_HANDLING=y in the port's config unless the environment says).
  bool allow_shared_memory = true;
  std::chrono::milliseconds unclaimed{10000};  // how long an opened message waits for expect()
};

class TensorPort {
 public:
  using Clock = std::chrono::steady_clock;
  using Sent = std::function<void(const std::string& error)>;                 // "" once the message left
  using Arrived = std::function<void(const std::string& error, std::string data)>;  // data: the plain bytes

  explicit TensorPort(PortOptions options = {});
  ~TensorPort();
  TensorPort(const TensorPort&) = delete;
  TensorPort& operator=(const TensorPort&) = delete;

  // This worker's UCX address, for the peer's add_peer.
  const std::string& address() const;

  // A peer at UCX `address` sealing with `key`. Its messages are accepted up to
  // `max_message` plain bytes each and `max_unclaimed` bytes waiting at once.
  // Returns the port's id for it (its messages carry it): `id`, or with 0 one the
  // port picks (1..kMaxPeerId). Throws moe::InvalidArgument for an address UCX
  // cannot reach, an id in use, or a full port.
  uint32_t add_peer(const std::string& address, const Key& key, size_t max_message, size_t max_unclaimed,
                    uint32_t id = 0);
  // The peer's expectations fail, its waiting messages go.
  void remove_peer(uint32_t peer);
  size_t peers() const;
  // Messages dropped so far (not from a peer, unopenable, over a limit, unclaimed).
  uint64_t dropped() const;

  // Seals n bytes and sends them to `peer` under `tag`; `sent` runs on the port's
  // thread when they left or failed. The bytes are copied (sealed) before it returns.
  void send(uint32_t peer, uint64_t tag, const void* plain, size_t n, Sent sent);
  // `arrived` runs once on the port's thread: with the message `tag` from `peer`
  // (exactly `bytes` plain bytes), or the error (the deadline, the peer failed or left).
  void expect(uint32_t peer, uint64_t tag, size_t bytes, Clock::time_point deadline, Arrived arrived);

  // Blocking forms for a client thread: throw moe::Error with the error.
  void send_and_wait(uint32_t peer, uint64_t tag, const void* plain, size_t n, Clock::time_point deadline);
  std::string take(uint32_t peer, uint64_t tag, size_t bytes, Clock::time_point deadline);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::tensor_wire
