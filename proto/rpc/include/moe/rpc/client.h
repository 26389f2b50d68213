// The control plane's client (docs/control-plane.md#framing): blocking calls with a
// deadline over the framed RPC, the token sent in the first frame. Free of
// Boost.Asio (the CLI and the daemon's ranks include only this); the server side
// is server.h.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "moe/rpc/frame.h"

namespace moe::rpc {

// "HOST:PORT" -> parts; throws moe::InvalidArgument naming the text.
std::pair<std::string, int> split_address(const std::string& address);
// The token in a file (surrounding whitespace removed); throws naming the file
// when it cannot be read or holds no token.
std::string read_token_file(const std::string& path);

// The control plane's TLS (docs/control-plane.md#tls), as PEM files: this
// process's certificate and key, and the CA that signed its peers'. All empty:
// plain TCP. Otherwise all three are needed: every connection is mutual TLS 1.3,
// each side verifying the other's certificate against the CA.
struct TlsFiles {
  std::string cert;
  std::string key;
  std::string ca;
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
  // Throws moe::InvalidArgument naming a missing file or a flag given alone.
  void check() const;
};

struct ClientOptions {
  std::string address;  // HOST:PORT
  std::string token;
  TlsFiles tls;         // the server's certificate must name the address's host
  std::string role;     // told to the server in Hello
  std::string name;
  std::string session;  // told to the server in Hello (a client library's session)
  size_t max_frame_bytes = kDefaultMaxFrameBytes;

  static ClientOptions make(std::string address, std::string token, std::string role, std::string name,
                            TlsFiles tls = {}) {
    ClientOptions o;
    o.address = std::move(address);
    o.token = std::move(token);
    o.tls = std::move(tls);
    o.role = std::move(role);
    o.name = std::move(name);
    return o;
  }
};

// Thread-safe; one call at a time on one connection, reconnecting after a failure.
class RpcClient {
 public:
  explicit RpcClient(ClientOptions options);
  RpcClient(RpcClient&&) noexcept;
  ~RpcClient();
  // Sends `request` (any payload) and returns the reply payload. Throws RpcError:
  // the server's error, or UNAVAILABLE / DEADLINE_EXCEEDED naming the address.
  v1::Envelope call(v1::Envelope request, std::chrono::milliseconds timeout);
  const std::string& address() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::rpc
