// Frames of the control plane: a 4-byte big-endian length, then one Envelope.
// Shared by the server and the client, and fuzzed on its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "moe/base/check.h"
#include "moe/v1/rpc.pb.h"

namespace moe::rpc {

constexpr size_t kDefaultMaxFrameBytes = 16u << 20;

// A control-plane failure with the code a reply carries: an error reply, or a
// peer that could not be reached (UNAVAILABLE, DEADLINE_EXCEEDED). A moe::Error
// like any other; a handler may throw moe::InvalidArgument instead of
// RpcError(INVALID_ARGUMENT), and anything else becomes INTERNAL
// (docs/control-plane.md#errors).
class RpcError : public Error {
 public:
  enum class Peer { kAnswered, kUnreached };
  RpcError(v1::ErrorCode code, const std::string& message, Peer peer = Peer::kAnswered)
      : Error(message), code_(code), peer_(peer) {}
  v1::ErrorCode code() const { return code_; }
  // The peer could not be reached, or the connection broke mid-call: the call
  // may or may not have run there (a caller may send an idempotent call elsewhere).
  bool unreached() const { return peer_ == Peer::kUnreached; }

 private:
  v1::ErrorCode code_;
  Peer peer_;
};

// The frame bytes of an envelope.
std::string encode_frame(const v1::Envelope& env);
// The length in a 4-byte header.
uint32_t decode_length(const uint8_t header[4]);
// Parses a frame body; throws RpcError(BAD_FRAME) naming the problem.
v1::Envelope decode_body(const uint8_t* data, size_t size);

v1::Envelope make_error(v1::ErrorCode code, const std::string& message, uint64_t request_id = 0);
// Throws RpcError if env is an error reply; returns env otherwise.
const v1::Envelope& check_reply(const v1::Envelope& env);
// "submit_job", "job", ...: the oneof field name of the payload, for messages and logs.
std::string payload_name(const v1::Envelope& env);

}  // namespace moe::rpc
