#include "moe/rpc/server.h"

#include <unistd.h>

#include <sys/socket.h>

#include <cerrno>
#include <optional>
#include <vector>

#include "frame_io.h"
#include "moe/base/log.h"

namespace moe::rpc {

using asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kDefaultRequestDeadline = std::chrono::seconds(30);
constexpr int64_t kMaxRequestDeadlineMs = 3600 * 1000;
constexpr auto kHandshakeTimeout = std::chrono::seconds(10);

}  // namespace

// A connection and its events (ConnectionEvents): all on the io thread. While a
// handler with an on_peer_gone callback runs, the socket is watched for the
// peer's FIN or RST (a peek, which takes nothing from the stream); the watch is
// cancelled before the reply is written.
struct RpcServer::Connection : ConnectionEvents, std::enable_shared_from_this<Connection> {
  Connection(tcp::socket s, uint64_t id) : conn(std::move(s)), id_(id) {}
  detail::Connection conn;
  std::string peer;

  void on_close(std::function<void()> f) override {
    if (closed_) return f();
    on_close_.push_back(std::move(f));
  }
  void on_peer_gone(std::function<void()> f) override {
    if (closed_) return f();
    on_gone_.push_back(std::move(f));
    if (in_handler_ && !watching_) watch();
  }
  uint64_t id() const override { return id_; }

  void handler_begins() { in_handler_ = true; }
  void handler_ends() {
    in_handler_ = false;
    on_gone_.clear();
    ++generation_;  // a watch that already fired is ignored
    if (watching_) {
      boost::system::error_code ec;
      conn.socket().cancel(ec);  // nothing else is pending: the reply's write comes next
      watching_ = false;
    }
  }
  // The connection ended: every callback runs, once.
  void closed() {
    if (closed_) return;
    closed_ = true;
    const auto gone = std::move(on_gone_);
    const auto close = std::move(on_close_);
    for (const auto& f : gone) f();
    for (const auto& f : close) f();
  }

 private:
  void watch() {
    watching_ = true;
    conn.socket().async_wait(tcp::socket::wait_read, [self = shared_from_this(), gen = generation_](
                                                          boost::system::error_code ec) {
      if (ec || gen != self->generation_ || !self->in_handler_) return;
      self->watching_ = false;
      char byte;
      const ssize_t n = ::recv(self->conn.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
        self->closed();  // FIN or RST: no reply can reach the peer
      else if (n < 0)
        self->watch();
      // n > 0: the peer sent more (a pipelined frame, a TLS alert); the next read takes it
    });
  }

  const uint64_t id_;
  bool in_handler_ = false, watching_ = false, closed_ = false;
  uint64_t generation_ = 0;
  std::vector<std::function<void()>> on_close_, on_gone_;
};

RpcServer::RpcServer(asio::io_context& io, ServerOptions options, Handler handler)
    : io_(io), opts_(std::move(options)), handler_(std::move(handler)), acceptor_(io) {
  if (opts_.tls.enabled()) tls_ = std::make_unique<detail::ssl::context>(detail::server_context(opts_.tls));
  const tcp::endpoint ep(asio::ip::make_address(opts_.host), static_cast<unsigned short>(opts_.port));
  acceptor_.open(ep.protocol());
  acceptor_.set_option(tcp::acceptor::reuse_address(true));
  acceptor_.bind(ep);
  acceptor_.listen();
  port_ = acceptor_.local_endpoint().port();
  asio::co_spawn(io_, accept_loop(), asio::detached);
}

RpcServer::~RpcServer() { stop(); }

std::string RpcServer::address() const { return opts_.host + ":" + std::to_string(port_); }

std::string RpcServer::advertised_address() const {
  if (opts_.host != "0.0.0.0" && opts_.host != "::" && !opts_.host.empty()) return address();
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);  // bound to every interface: the host's name reaches it
  return std::string(name) + ":" + std::to_string(port_);
}

void RpcServer::stop() {
  if (stopped_) return;
  stopped_ = true;
  boost::system::error_code ec;
  acceptor_.close(ec);
  for (const auto& c : connections_) c->conn.close();
  connections_.clear();
}

awaitable<void> RpcServer::accept_loop() {
  while (!stopped_) {
    boost::system::error_code ec;
    tcp::socket s = co_await acceptor_.async_accept(asio::redirect_error(use_awaitable, ec));
    if (ec) {
      if (stopped_ || ec == asio::error::operation_aborted) co_return;
      continue;  // e.g. the client reset before we accepted
    }
    // A reply goes out as a header and a body: without this, Nagle holds the body
    // until the client's delayed ACK (40 ms on Linux) for replies of a few kB to ~100 kB.
    s.set_option(tcp::no_delay(true), ec);
    auto conn = std::make_shared<Connection>(std::move(s), ++connections_made_);
    boost::system::error_code pe;
    const auto remote = conn->conn.socket().remote_endpoint(pe);
    conn->peer = pe ? "?" : remote.address().to_string() + ":" + std::to_string(remote.port());
    connections_.insert(conn);
    asio::co_spawn(io_, serve(conn), asio::detached);
  }
}

// TLS from the first byte, within kHandshakeTimeout. A plain client is told in
// its own framing that TLS is required; a failed handshake is logged. False: the
// connection is done.
awaitable<bool> RpcServer::secure(std::shared_ptr<Connection> conn) {
  asio::steady_timer timer(io_);
  timer.expires_after(kHandshakeTimeout);
  timer.async_wait([conn](boost::system::error_code ec) {
    if (!ec) conn->conn.close();
  });
  bool secured = false;
  try {
    uint8_t first = 0;
    co_await conn->conn.socket().async_receive(asio::buffer(&first, 1), tcp::socket::message_peek, use_awaitable);
    if (first == detail::kTlsHandshakeRecord) {
      co_await conn->conn.handshake(*tls_, detail::ssl::stream_base::server, "");
      secured = true;
    } else {
      uint64_t id = 0;  // the request's, when its frame is one
      try {
        id = (co_await conn->conn.read(opts_.max_frame_bytes)).request_id();
      } catch (const RpcError&) {
      }
      co_await conn->conn.try_write(make_error(
          v1::ERROR_CODE_UNAUTHENTICATED, opts_.role + " at " + address() + " requires TLS: give --tls-ca, --tls-cert and --tls-key", id));
    }
  } catch (const boost::system::system_error& e) {
    if (e.code() != asio::error::operation_aborted && e.code() != asio::error::eof)
      log::warn("TLS handshake with ", conn->peer, " failed: ", detail::handshake_failure(e.code(), true));
  } catch (const std::exception&) {
  }
  timer.cancel();
  co_return secured;
}

awaitable<void> RpcServer::serve(std::shared_ptr<Connection> conn) {
  if (tls_ && !co_await secure(conn)) {
    conn->conn.close();
    connections_.erase(conn);
    co_return;
  }
  bool authenticated = false;
  RequestContext ctx;
  ctx.peer = conn->peer;
  ctx.connection = conn.get();
  for (;;) {
    v1::Envelope request;
    std::optional<v1::Envelope> fatal;  // an error reply after which the connection closes
    try {
      request = co_await conn->conn.read(opts_.max_frame_bytes);
    } catch (const RpcError& e) {
      fatal = make_error(e.code(), e.what());
    } catch (const std::exception&) {
      break;  // the peer went away
    }
    if (!fatal && !authenticated) {
      if (!request.has_hello()) {
        fatal = make_error(v1::ERROR_CODE_UNAUTHENTICATED, "the first frame must be hello", request.request_id());
      } else if (!opts_.token.empty() && request.hello().token() != opts_.token) {
        fatal = make_error(v1::ERROR_CODE_UNAUTHENTICATED, "bad cluster token", request.request_id());
      } else {
        authenticated = true;
        ctx.client_role = request.hello().role();
        ctx.client_name = request.hello().name();
        ctx.client_session = request.hello().session();
        v1::Envelope reply;
        reply.set_request_id(request.request_id());
        reply.mutable_hello_reply()->set_role(opts_.role);
        reply.mutable_hello_reply()->set_version("moe.v1");
        if (!co_await conn->conn.try_write(reply)) break;
        continue;
      }
    }
    if (fatal) {
      co_await conn->conn.try_write(*fatal);
      break;
    }
    // A handler stops waiting a little before the caller gives up, so a wait that
    // runs out ends with a reply, not with silence: a quarter of the time (at most
    // 500 ms) covers the request's way in and the reply's way back. A tenth did
    // not on a loaded machine: `moectl job wait --timeout 1` under ASan got no
    // reply within its second instead of "had not ended".
    // Clamped: an absurd deadline_ms must not overflow the clock arithmetic.
    const auto allowed = request.deadline_ms() > 0
                             ? std::chrono::milliseconds(std::min<int64_t>(request.deadline_ms(), kMaxRequestDeadlineMs))
                             : std::chrono::milliseconds(kDefaultRequestDeadline);
    ctx.deadline = Clock::now() + allowed - std::min<std::chrono::milliseconds>(allowed / 4, std::chrono::milliseconds(500));
    v1::Envelope reply;
    conn->handler_begins();
    try {
      reply = co_await handler_(request, ctx);
    } catch (const RpcError& e) {
      reply = make_error(e.code(), e.what());
    } catch (const InvalidArgument& e) {
      reply = make_error(v1::ERROR_CODE_INVALID_ARGUMENT, e.what());
    } catch (const std::exception& e) {
      reply = make_error(v1::ERROR_CODE_INTERNAL, e.what());
    }
    conn->handler_ends();
    reply.set_request_id(request.request_id());
    if (!co_await conn->conn.try_write(reply)) break;
  }
  conn->conn.close();
  conn->closed();
  connections_.erase(conn);
}

}  // namespace moe::rpc
