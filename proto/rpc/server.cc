#include "moe/rpc/server.h"

#include <unistd.h>

#include <sys/socket.h>

#include <cerrno>
#include <optional>
#include <vector>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "frame_io.h"
#include "moe/base/log.h"

namespace moe::rpc {

using asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kDefaultRequestDeadline = std::chrono::seconds(30);
constexpr int64_t kMaxRequestDeadlineMs = 3600 * 1000;

// The token in constant time: SHA-256 of both, compared with CRYPTO_memcmp, so
// neither the matching prefix nor the length shows in the time taken.
bool same_token(const std::string& given, const std::string& expected) {
  unsigned char a[EVP_MAX_MD_SIZE], b[EVP_MAX_MD_SIZE];
  unsigned int na = 0, nb = 0;
  if (EVP_Digest(given.data(), given.size(), a, &na, EVP_sha256(), nullptr) != 1 ||
      EVP_Digest(expected.data(), expected.size(), b, &nb, EVP_sha256(), nullptr) != 1)
    return false;
  return na == nb && CRYPTO_memcmp(a, b, na) == 0;
}

}  // namespace

// A connection and its events (ConnectionEvents): all on the io thread. While a
// handler with an on_peer_gone callback runs, the socket is watched for the
// peer's FIN or RST (a peek, which takes nothing from the stream); the watch is
// cancelled before the reply is written.
struct RpcServer::Connection : ConnectionEvents, std::enable_shared_from_this<Connection> {
  Connection(tcp::socket s, uint64_t id) : conn(std::move(s)), id_(id) {}
  detail::Connection conn;
  std::string peer;
  bool authenticated = false;  // passed Hello
  bool counted = false;        // counts in unauthenticated_ (accepted, not yet authenticated or evicted)

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
      if (ec == asio::error::no_descriptors || ec.value() == ENFILE) {  // out of files: wait, do not spin
        asio::steady_timer pause(io_, std::chrono::milliseconds(100));
        co_await pause.async_wait(asio::redirect_error(use_awaitable, ec));
      }
      continue;  // e.g. the client reset before we accepted
    }
    make_room_for_a_stranger();
    // A reply goes out as a header and a body: without this, Nagle holds the body
    // until the client's delayed ACK (40 ms on Linux) for replies of a few kB to ~100 kB.
    s.set_option(tcp::no_delay(true), ec);
    auto conn = std::make_shared<Connection>(std::move(s), ++connections_made_);
    boost::system::error_code pe;
    const auto remote = conn->conn.socket().remote_endpoint(pe);
    conn->peer = pe ? "?" : remote.address().to_string() + ":" + std::to_string(remote.port());
    connections_.insert(conn);
    conn->counted = true;
    ++unauthenticated_;
    awaiting_hello_.push_back(conn);
    asio::co_spawn(io_, serve(conn), asio::detached);
  }
}

void RpcServer::drop(const std::shared_ptr<Connection>& conn) {
  conn->conn.close();
  conn->closed();
  if (conn->counted) --unauthenticated_;
  conn->counted = false;
  connections_.erase(conn);
}

// At the cap of connections before Hello, the oldest goes: a client that speaks
// at once always gets in, and a stranger's silent connections only ever push out
// each other. Entries that passed Hello or went are pruned from the front.
void RpcServer::make_room_for_a_stranger() {
  auto stale = [](const std::weak_ptr<Connection>& w) {
    const auto c = w.lock();
    return !c || !c->counted;
  };
  while (!awaiting_hello_.empty() && stale(awaiting_hello_.front())) awaiting_hello_.pop_front();
  while (unauthenticated_ >= opts_.max_unauthenticated && !awaiting_hello_.empty()) {
    const auto oldest = awaiting_hello_.front().lock();
    awaiting_hello_.pop_front();
    if (!oldest || !oldest->counted) continue;
    oldest->counted = false;
    --unauthenticated_;
    oldest->conn.close();  // its serve() ends at its pending read
    if (Clock::now() - last_eviction_log_ > std::chrono::seconds(10)) {
      last_eviction_log_ = Clock::now();
      log::warn(opts_.role, ": ", opts_.max_unauthenticated, " connections have not passed Hello; closing the oldest "
                "(from ", oldest->peer, ") for each new one");
    }
  }
}

// TLS from the first byte (within the Hello deadline serve() sets). A plain
// client is told in its own framing that TLS is required; a failed handshake is
// logged. False: the connection is done.
awaitable<bool> RpcServer::secure(std::shared_ptr<Connection> conn) {
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
        id = (co_await conn->conn.read(opts_.max_hello_frame_bytes)).request_id();
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
  co_return secured;
}

// The first frame, at most max_hello_frame_bytes: a Hello with the cluster's
// token. Anything else gets an error reply, and the connection ends.
awaitable<bool> RpcServer::authenticate(std::shared_ptr<Connection> conn, RequestContext& ctx) {
  v1::Envelope request;
  std::optional<v1::Envelope> refusal;
  try {
    request = co_await conn->conn.read(opts_.max_hello_frame_bytes);
  } catch (const RpcError& e) {
    refusal = make_error(e.code(), std::string(e.what()) + " before hello");
  } catch (const std::exception&) {
    co_return false;  // the peer went away, or the Hello deadline closed it
  }
  if (!refusal && !request.has_hello())
    refusal = make_error(v1::ERROR_CODE_UNAUTHENTICATED, "the first frame must be hello", request.request_id());
  else if (!refusal && !opts_.token.empty() && !same_token(request.hello().token(), opts_.token))
    refusal = make_error(v1::ERROR_CODE_UNAUTHENTICATED, "bad cluster token", request.request_id());
  if (refusal) {
    co_await conn->conn.try_write(*refusal);
    co_return false;
  }
  conn->authenticated = true;
  if (conn->counted) --unauthenticated_;
  conn->counted = false;
  ctx.client_role = request.hello().role();
  ctx.client_name = request.hello().name();
  ctx.client_session = request.hello().session();
  v1::Envelope reply;
  reply.set_request_id(request.request_id());
  reply.mutable_hello_reply()->set_role(opts_.role);
  reply.mutable_hello_reply()->set_version("moe.v1");
  co_return co_await conn->conn.try_write(reply);
}

awaitable<void> RpcServer::serve(std::shared_ptr<Connection> conn) {
  // TLS and Hello within hello_timeout, in every mode: a connection that says
  // nothing holds no slot for long.
  asio::steady_timer hello_deadline(io_);
  hello_deadline.expires_after(opts_.hello_timeout);
  hello_deadline.async_wait([conn](boost::system::error_code ec) {
    if (!ec && !conn->authenticated) conn->conn.close();
  });
  RequestContext ctx;
  ctx.peer = conn->peer;
  ctx.connection = conn.get();
  bool admitted = !tls_ || co_await secure(conn);
  if (admitted) admitted = co_await authenticate(conn, ctx);
  hello_deadline.cancel();
  if (!admitted) {
    drop(conn);
    co_return;
  }
  for (;;) {
    v1::Envelope request;
    std::optional<v1::Envelope> bad_frame;  // replied, then the connection closes
    try {
      request = co_await conn->conn.read(opts_.max_frame_bytes);
    } catch (const RpcError& e) {
      bad_frame = make_error(e.code(), e.what());
    } catch (const std::exception&) {
      break;  // the peer went away
    }
    if (bad_frame) {
      co_await conn->conn.try_write(*bad_frame);
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
  drop(conn);
}

}  // namespace moe::rpc
