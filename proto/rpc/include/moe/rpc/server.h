// The control plane's server (docs/control-plane.md#framing): serves one request
// at a time per connection with a coroutine handler over Boost.Asio, checks the
// cluster token in the first frame (Hello) and enforces the frame size limit.
// Only the processes that serve (moed, moe-agent) include it.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "moe/rpc/asio.h"
#include "moe/rpc/client.h"

namespace boost::asio::ssl {
class context;
}

namespace moe::rpc {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;           // 0: an ephemeral port (see RpcServer::port)
  std::string token;      // empty: no authentication
  TlsFiles tls;           // empty: plain TCP; else clients must present a certificate the CA signed
  std::string role;       // told to clients in HelloReply
  size_t max_frame_bytes = kDefaultMaxFrameBytes;
  // Before Hello succeeds (docs/control-plane.md#before-authentication): frames
  // up to this size, the TLS handshake and Hello within this time, and at most
  // this many such connections at once (a new one closes the oldest).
  size_t max_hello_frame_bytes = 4096;
  std::chrono::milliseconds hello_timeout{10000};
  size_t max_unauthenticated = 256;

  // listen is HOST:PORT; throws moe::InvalidArgument naming it when malformed.
  static ServerOptions make(const std::string& listen, std::string token, std::string role, TlsFiles tls = {}) {
    const auto [h, p] = split_address(listen);
    ServerOptions o;
    o.host = h;
    o.port = p;
    o.token = std::move(token);
    o.tls = std::move(tls);
    o.role = std::move(role);
    return o;
  }
};

// The connection a request came on, for a handler whose work outlives a call
// (docs/control-plane.md#connections). Callbacks run once, on the server's io
// thread; register them from the handler (the io thread).
class ConnectionEvents {
 public:
  virtual ~ConnectionEvents() = default;
  // Runs `f` when the connection ends: the peer closed or reset it (seen while
  // the connection waits for its next request, or while a handler runs), or
  // the server stops.
  virtual void on_close(std::function<void()> f) = 0;
  // Runs `f` if the peer closes or resets the connection while this request's
  // handler runs (no reply can reach it); dropped once the handler returns.
  virtual void on_peer_gone(std::function<void()> f) = 0;
  // This connection's number, unique in the server's life.
  virtual uint64_t id() const = 0;
};

// What a handler knows about the request it serves.
struct RequestContext {
  std::string peer;        // "ip:port"
  std::string client_role;
  std::string client_name;
  std::string client_session;  // Hello.session: a client's connections that are one session ("": none)
  ConnectionEvents* connection = nullptr;  // valid while the handler runs
  // From the request's deadline_ms (or a default), less a margin so the reply
  // reaches the caller before it gives up.
  asio::steady_timer::time_point deadline;
};

// A handler returns the reply payload (request_id is filled in by the server).
// Throw RpcError for an error reply with its code, moe::InvalidArgument for
// INVALID_ARGUMENT; anything else becomes INTERNAL.
using Handler = std::function<awaitable<v1::Envelope>(const v1::Envelope& request, const RequestContext& ctx)>;

class RpcServer {
 public:
  RpcServer(asio::io_context& io, ServerOptions options, Handler handler);
  ~RpcServer();
  int port() const { return port_; }
  std::string address() const;  // "host:port" as bound
  // What peers should dial: the bound address, or the host name when bound to
  // every interface (0.0.0.0).
  std::string advertised_address() const;
  void stop();                  // stop accepting and close every connection
  // Connections accepted that have not passed Hello (io thread).
  size_t unauthenticated() const { return unauthenticated_; }

 private:
  struct Connection;
  awaitable<void> accept_loop();
  awaitable<void> serve(std::shared_ptr<Connection> conn);
  awaitable<bool> secure(std::shared_ptr<Connection> conn);
  // Reads the Hello and checks its token; true when the connection may go on.
  awaitable<bool> authenticate(std::shared_ptr<Connection> conn, RequestContext& ctx);
  void drop(const std::shared_ptr<Connection>& conn);
  void make_room_for_a_stranger();

  asio::io_context& io_;
  ServerOptions opts_;
  Handler handler_;
  std::unique_ptr<asio::ssl::context> tls_;  // null: plain TCP
  asio::ip::tcp::acceptor acceptor_;
  int port_ = 0;
  std::set<std::shared_ptr<Connection>> connections_;
  uint64_t connections_made_ = 0;
  size_t unauthenticated_ = 0;  // connections accepted that have not passed Hello
  std::deque<std::weak_ptr<Connection>> awaiting_hello_;  // in accept order; stale entries pruned
  std::chrono::steady_clock::time_point last_eviction_log_{};
  bool stopped_ = false;
};

}  // namespace moe::rpc
