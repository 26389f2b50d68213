#include "moe/rpc/frame.h"

#include <google/protobuf/stubs/logging.h>

namespace moe::rpc {

std::string encode_frame(const v1::Envelope& env) {
  std::string body;
  env.SerializeToString(&body);
  const uint32_t n = static_cast<uint32_t>(body.size());
  std::string frame(4, '\0');
  frame[0] = static_cast<char>(n >> 24);
  frame[1] = static_cast<char>(n >> 16);
  frame[2] = static_cast<char>(n >> 8);
  frame[3] = static_cast<char>(n);
  return frame + body;
}

uint32_t decode_length(const uint8_t h[4]) {
  return static_cast<uint32_t>(h[0]) << 24 | static_cast<uint32_t>(h[1]) << 16 | static_cast<uint32_t>(h[2]) << 8 | h[3];
}

v1::Envelope decode_body(const uint8_t* data, size_t size) {
  v1::Envelope env;
  // A bad frame is answered with an error naming it; protobuf's own log line
  // (e.g. about invalid UTF-8) would let any client fill our logs.
  const google::protobuf::LogSilencer quiet;
  if (!env.ParseFromArray(data, static_cast<int>(size)))
    throw RpcError(v1::ERROR_CODE_BAD_FRAME, "frame of " + std::to_string(size) + " bytes is not a valid Envelope");
  if (env.payload_case() == v1::Envelope::PAYLOAD_NOT_SET)
    throw RpcError(v1::ERROR_CODE_BAD_FRAME, "frame carries no payload");
  return env;
}

v1::Envelope make_error(v1::ErrorCode code, const std::string& message, uint64_t request_id) {
  v1::Envelope env;
  env.set_request_id(request_id);
  env.mutable_error()->set_code(code);
  env.mutable_error()->set_message(message);
  return env;
}

const v1::Envelope& check_reply(const v1::Envelope& env) {
  if (env.has_error()) throw RpcError(env.error().code(), env.error().message());
  return env;
}

std::string payload_name(const v1::Envelope& env) {
  const auto* field = v1::Envelope::descriptor()->FindFieldByNumber(static_cast<int>(env.payload_case()));
  return field ? field->name() : "none";
}

}  // namespace moe::rpc
