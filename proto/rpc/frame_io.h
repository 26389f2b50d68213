// Frames over a connection, for the server and the client: TLS over TCP, or
// plain TCP. Private to proto/rpc.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "moe/rpc/asio.h"
#include "moe/rpc/frame.h"
#include "tls.h"

namespace moe::rpc::detail {

using asio::ip::tcp;

template <typename Stream>
awaitable<void> write_frame(Stream& s, const v1::Envelope& env) {
  const std::string frame = encode_frame(env);
  co_await asio::async_write(s, asio::buffer(frame), use_awaitable);
}

// Reads one frame; throws RpcError(BAD_FRAME) for an oversized or unparsable one.
template <typename Stream>
awaitable<v1::Envelope> read_frame(Stream& s, size_t max_bytes) {
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

// One connection: a TCP socket, and the TLS stream over it once TLS is on.
class Connection {
 public:
  explicit Connection(tcp::socket s) : plain_(std::make_unique<tcp::socket>(std::move(s))) {}
  explicit Connection(asio::io_context& io) : plain_(std::make_unique<tcp::socket>(io)) {}

  tcp::socket& socket() { return tls_ ? tls_->next_layer() : *plain_; }
  bool secure() const { return tls_ != nullptr; }

  // Wraps the socket in TLS and runs the handshake; throws the handshake's error.
  awaitable<void> handshake(ssl::context& ctx, ssl::stream_base::handshake_type side, const std::string& host) {
    tls_ = std::make_unique<ssl::stream<tcp::socket>>(std::move(*plain_), ctx);
    plain_.reset();
    if (side == ssl::stream_base::client) {
      tls_->set_verify_callback(ssl::host_name_verification(host));
      SSL_set_tlsext_host_name(tls_->native_handle(), host.c_str());
    }
    co_await tls_->async_handshake(side, use_awaitable);
  }

  awaitable<v1::Envelope> read(size_t max_bytes) { return tls_ ? read_frame(*tls_, max_bytes) : read_frame(*plain_, max_bytes); }
  awaitable<void> write(const v1::Envelope& env) { return tls_ ? write_frame(*tls_, env) : write_frame(*plain_, env); }

  // A server's reply: false when the peer has gone, which ends the connection.
  awaitable<bool> try_write(const v1::Envelope& env) {
    try {
      co_await write(env);
    } catch (const std::exception&) {
      co_return false;
    }
    co_return true;
  }

  void close() {
    boost::system::error_code ec;
    socket().close(ec);
  }

 private:
  std::unique_ptr<tcp::socket> plain_;
  std::unique_ptr<ssl::stream<tcp::socket>> tls_;
};

}  // namespace moe::rpc::detail
