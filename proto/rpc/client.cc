#include "moe/rpc/client.h"

#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>

#include "frame_io.h"

namespace moe::rpc {

using asio::ip::tcp;
using detail::Connection;
using Clock = std::chrono::steady_clock;

std::pair<std::string, int> split_address(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size())
    throw InvalidArgument("address '" + address + "' is not HOST:PORT");
  const std::string host = address.substr(0, colon), port_text = address.substr(colon + 1);
  int port = 0;
  for (char c : port_text) {
    if (c < '0' || c > '9' || port > 65535)
      throw InvalidArgument("address '" + address + "' has a bad port");
    port = port * 10 + (c - '0');
  }
  if (port > 65535) throw InvalidArgument("address '" + address + "' has a bad port");
  return {host, port};
}

std::string read_token_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InvalidArgument("cannot read token file " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string t = ss.str();
  const auto b = t.find_first_not_of(" \t\r\n"), e = t.find_last_not_of(" \t\r\n");
  // An empty token would turn authentication off without a word.
  if (b == std::string::npos)
    throw InvalidArgument("token file " + path + " is empty: a cluster token is one line of random text (moectl "
                          "cluster up writes one; or: openssl rand -hex 24 > " + path + ")");
  return t.substr(b, e - b + 1);
}

struct RpcClient::Impl {
  explicit Impl(ClientOptions o) : opts(std::move(o)) {
    if (opts.tls.enabled()) tls.emplace(detail::client_context(opts.tls));
  }
  awaitable<void> connect_and_hello();
  awaitable<v1::Envelope> roundtrip(const v1::Envelope& request);

  ClientOptions opts;
  std::optional<detail::ssl::context> tls;
  std::mutex mu;
  asio::io_context io;
  std::unique_ptr<Connection> conn;
  uint64_t next_id = 1;
};

RpcClient::RpcClient(ClientOptions options) {
  split_address(options.address);
  impl_ = std::make_unique<Impl>(std::move(options));
}

RpcClient::RpcClient(RpcClient&&) noexcept = default;

RpcClient::~RpcClient() {
  if (impl_ && impl_->conn) impl_->conn->close();
}

const std::string& RpcClient::address() const { return impl_->opts.address; }

awaitable<void> RpcClient::Impl::connect_and_hello() {
  const auto [host, port] = split_address(opts.address);
  tcp::resolver resolver(io);
  const auto endpoints = co_await resolver.async_resolve(host, std::to_string(port), use_awaitable);
  // conn is set before connecting, so a deadline that closes it also ends a
  // connect to a host that never answers.
  conn = std::make_unique<Connection>(io);
  co_await asio::async_connect(conn->socket(), endpoints, use_awaitable);
  // A loopback connect to a port nobody listens on can pick that same port as
  // its own and connect to itself (TCP simultaneous open). That socket would
  // then hold the port a restarting server needs; treat it as refused.
  if (conn->socket().local_endpoint() == conn->socket().remote_endpoint()) {
    conn->close();
    throw boost::system::system_error(asio::error::connection_refused, "connected to itself");
  }
  conn->socket().set_option(tcp::no_delay(true));
  if (tls) co_await conn->handshake(*tls, detail::ssl::stream_base::client, host);
  v1::Envelope hello;
  hello.set_request_id(next_id++);
  hello.mutable_hello()->set_token(opts.token);
  hello.mutable_hello()->set_role(opts.role);
  hello.mutable_hello()->set_name(opts.name);
  hello.mutable_hello()->set_session(opts.session);
  check_reply(co_await roundtrip(hello));
}

awaitable<v1::Envelope> RpcClient::Impl::roundtrip(const v1::Envelope& request) {
  co_await conn->write(request);
  v1::Envelope reply = co_await conn->read(opts.max_frame_bytes);
  if (reply.request_id() != request.request_id() && !reply.has_error())
    throw RpcError(v1::ERROR_CODE_BAD_FRAME, "reply " + std::to_string(reply.request_id()) + " to request " +
                                                 std::to_string(request.request_id()));
  co_return reply;
}

v1::Envelope RpcClient::call(v1::Envelope request, std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  const auto deadline = Clock::now() + timeout;
  request.set_request_id(m.next_id++);
  request.set_deadline_ms(timeout.count());
  std::optional<v1::Envelope> reply;
  std::exception_ptr error;
  bool done = false;
  m.io.restart();
  asio::co_spawn(
      m.io,
      [&]() -> awaitable<void> {
        if (!m.conn) co_await m.connect_and_hello();
        reply = co_await m.roundtrip(request);
      },
      [&](std::exception_ptr e) {
        error = e;
        done = true;
      });
  m.io.run_until(deadline);
  if (!done) {
    // Deadline: close the socket so the pending operation completes, then drain.
    if (m.conn) m.conn->close();
    m.io.restart();
    m.io.run();
    m.conn.reset();
    throw RpcError(v1::ERROR_CODE_DEADLINE_EXCEEDED, "no reply from " + m.opts.address + " within " +
                                                         std::to_string(timeout.count()) + " ms (" +
                                                         payload_name(request) + ")");
  }
  if (error) {
    m.conn.reset();
    try {
      std::rethrow_exception(error);
    } catch (const RpcError&) {
      throw;
    } catch (const boost::system::system_error& e) {
      constexpr auto unreached = RpcError::Peer::kUnreached;
      if (e.code() == asio::ssl::error::stream_truncated || e.code() == asio::error::eof)
        throw RpcError(v1::ERROR_CODE_UNAVAILABLE, "cannot reach " + m.opts.address + ": the connection closed mid-call",
                       unreached);
      if (e.code().category() == asio::error::get_ssl_category())
        throw RpcError(v1::ERROR_CODE_UNAVAILABLE, "TLS with " + m.opts.address + " failed: " +
                                                       detail::handshake_failure(e.code(), false));
      throw RpcError(v1::ERROR_CODE_UNAVAILABLE, "cannot reach " + m.opts.address + ": " + e.what(), unreached);
    } catch (const std::exception& e) {
      throw RpcError(v1::ERROR_CODE_UNAVAILABLE, "cannot reach " + m.opts.address + ": " + e.what(),
                     RpcError::Peer::kUnreached);
    }
  }
  if (reply->has_error()) {
    const auto code = reply->error().code();
    if (code == v1::ERROR_CODE_BAD_FRAME || code == v1::ERROR_CODE_UNAUTHENTICATED) m.conn.reset();  // server closed it
    throw RpcError(code, reply->error().message());
  }
  return std::move(*reply);
}

}  // namespace moe::rpc
