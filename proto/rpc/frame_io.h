// Frames over an Asio socket, for the server and the client. Private to proto/rpc.
#pragma once

#include <string>
#include <vector>

#include "moe/rpc/asio.h"
#include "moe/rpc/frame.h"

namespace moe::rpc::detail {

using asio::ip::tcp;

inline awaitable<void> write_frame(tcp::socket& s, const v1::Envelope& env) {
  const std::string frame = encode_frame(env);
  co_await asio::async_write(s, asio::buffer(frame), use_awaitable);
}

// A server's reply: false when the peer has gone, which ends the connection.
inline awaitable<bool> try_write_frame(tcp::socket& s, const v1::Envelope& env) {
  try {
    co_await write_frame(s, env);
  } catch (const std::exception&) {
    co_return false;
  }
  co_return true;
}

// Reads one frame; throws RpcError(BAD_FRAME) for an oversized or unparsable one.
inline awaitable<v1::Envelope> read_frame(tcp::socket& s, size_t max_bytes) {
  uint8_t header[4];
  co_await asio::async_read(s, asio::buffer(header), use_awaitable);
  const uint32_t len = decode_length(header);
  if (len > max_bytes)
    throw RpcError(v1::ERROR_CODE_BAD_FRAME, "frame of " + std::to_string(len) + " bytes exceeds the limit of " +
                                                 std::to_string(max_bytes));
  std::vector<uint8_t> body(len);
  co_await asio::async_read(s, asio::buffer(body), use_awaitable);
  co_return decode_body(body.data(), body.size());
}

}  // namespace moe::rpc::detail
