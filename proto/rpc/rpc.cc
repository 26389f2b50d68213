#include "moe/rpc/rpc.h"

#include <unistd.h>

#include <fstream>
#include <optional>
#include <sstream>

namespace moe::rpc {

using asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kDefaultRequestDeadline = std::chrono::seconds(30);
constexpr int64_t kMaxRequestDeadlineMs = 3600 * 1000;

awaitable<void> write_frame(tcp::socket& s, const v1::Envelope& env) {
  const std::string frame = encode_frame(env);
  co_await asio::async_write(s, asio::buffer(frame), use_awaitable);
}

// A server's reply: false when the peer has gone, which ends the connection.
awaitable<bool> try_write_frame(tcp::socket& s, const v1::Envelope& env) {
  try {
    co_await write_frame(s, env);
  } catch (const std::exception&) {
    co_return false;
  }
  co_return true;
}

// Reads one frame; throws RpcError(BAD_FRAME) for an oversized or unparsable one.
awaitable<v1::Envelope> read_frame(tcp::socket& s, size_t max_bytes) {
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

}  // namespace

std::pair<std::string, int> split_address(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size())
    throw RpcError(v1::ERROR_CODE_INVALID_ARGUMENT, "address '" + address + "' is not HOST:PORT");
  const std::string host = address.substr(0, colon), port_text = address.substr(colon + 1);
  int port = 0;
  for (char c : port_text) {
    if (c < '0' || c > '9' || port > 65535)
      throw RpcError(v1::ERROR_CODE_INVALID_ARGUMENT, "address '" + address + "' has a bad port");
    port = port * 10 + (c - '0');
  }
  if (port > 65535) throw RpcError(v1::ERROR_CODE_INVALID_ARGUMENT, "address '" + address + "' has a bad port");
  return {host, port};
}

std::string read_token_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw RpcError(v1::ERROR_CODE_INVALID_ARGUMENT, "cannot read token file " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string t = ss.str();
  const auto b = t.find_first_not_of(" \t\r\n"), e = t.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? "" : t.substr(b, e - b + 1);
}

// ---------------------------------------------------------------------------

struct RpcServer::Connection {
  explicit Connection(tcp::socket s) : socket(std::move(s)) {}
  tcp::socket socket;
  std::string peer;
};

RpcServer::RpcServer(asio::io_context& io, ServerOptions options, Handler handler)
    : io_(io), opts_(std::move(options)), handler_(std::move(handler)), acceptor_(io) {
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
  for (const auto& c : connections_) c->socket.close(ec);
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
    auto conn = std::make_shared<Connection>(std::move(s));
    boost::system::error_code pe;
    const auto remote = conn->socket.remote_endpoint(pe);
    conn->peer = pe ? "?" : remote.address().to_string() + ":" + std::to_string(remote.port());
    connections_.insert(conn);
    asio::co_spawn(io_, serve(conn), asio::detached);
  }
}

awaitable<void> RpcServer::serve(std::shared_ptr<Connection> conn) {
  bool authenticated = false;
  RequestContext ctx;
  ctx.peer = conn->peer;
  for (;;) {
    v1::Envelope request;
    std::optional<v1::Envelope> fatal;  // an error reply after which the connection closes
    try {
      request = co_await read_frame(conn->socket, opts_.max_frame_bytes);
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
        v1::Envelope reply;
        reply.set_request_id(request.request_id());
        reply.mutable_hello_reply()->set_role(opts_.role);
        reply.mutable_hello_reply()->set_version("moe.v1");
        if (!co_await try_write_frame(conn->socket, reply)) break;
        continue;
      }
    }
    if (fatal) {
      co_await try_write_frame(conn->socket, *fatal);
      break;
    }
    // A handler stops waiting a little before the caller gives up, so a wait that
    // runs out ends with a reply, not with silence.
    // Clamped: an absurd deadline_ms must not overflow the clock arithmetic.
    const auto allowed = request.deadline_ms() > 0
                             ? std::chrono::milliseconds(std::min<int64_t>(request.deadline_ms(), kMaxRequestDeadlineMs))
                             : std::chrono::milliseconds(kDefaultRequestDeadline);
    ctx.deadline = Clock::now() + allowed - std::min<std::chrono::milliseconds>(allowed / 10, std::chrono::milliseconds(500));
    v1::Envelope reply;
    try {
      reply = co_await handler_(request, ctx);
    } catch (const RpcError& e) {
      reply = make_error(e.code(), e.what());
    } catch (const std::exception& e) {
      reply = make_error(v1::ERROR_CODE_INTERNAL, e.what());
    }
    reply.set_request_id(request.request_id());
    if (!co_await try_write_frame(conn->socket, reply)) break;
  }
  boost::system::error_code ec;
  conn->socket.close(ec);
  connections_.erase(conn);
}

// ---------------------------------------------------------------------------

RpcClient::RpcClient(ClientOptions options) : opts_(std::move(options)) { split_address(opts_.address); }

RpcClient::~RpcClient() {
  if (socket_) {
    boost::system::error_code ec;
    socket_->close(ec);
  }
}

awaitable<void> RpcClient::connect_and_hello() {
  const auto [host, port] = split_address(opts_.address);
  tcp::resolver resolver(io_);
  const auto endpoints = co_await resolver.async_resolve(host, std::to_string(port), use_awaitable);
  // socket_ is set before connecting, so a deadline that closes it also ends a
  // connect to a host that never answers.
  socket_ = std::make_unique<tcp::socket>(io_);
  co_await asio::async_connect(*socket_, endpoints, use_awaitable);
  socket_->set_option(tcp::no_delay(true));
  v1::Envelope hello;
  hello.set_request_id(next_id_++);
  hello.mutable_hello()->set_token(opts_.token);
  hello.mutable_hello()->set_role(opts_.role);
  hello.mutable_hello()->set_name(opts_.name);
  check_reply(co_await roundtrip(hello));
}

awaitable<v1::Envelope> RpcClient::roundtrip(const v1::Envelope& request) {
  co_await write_frame(*socket_, request);
  v1::Envelope reply = co_await read_frame(*socket_, opts_.max_frame_bytes);
  if (reply.request_id() != request.request_id() && !reply.has_error())
    throw RpcError(v1::ERROR_CODE_BAD_FRAME, "reply " + std::to_string(reply.request_id()) + " to request " +
                                                 std::to_string(request.request_id()));
  co_return reply;
}

v1::Envelope RpcClient::call(v1::Envelope request, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto deadline = Clock::now() + timeout;
  request.set_request_id(next_id_++);
  request.set_deadline_ms(timeout.count());
  std::optional<v1::Envelope> reply;
  std::exception_ptr error;
  bool done = false;
  io_.restart();
  asio::co_spawn(
      io_,
      [&]() -> awaitable<void> {
        if (!socket_) co_await connect_and_hello();
        reply = co_await roundtrip(request);
      },
      [&](std::exception_ptr e) {
        error = e;
        done = true;
      });
  io_.run_until(deadline);
  if (!done) {
    // Deadline: close the socket so the pending operation completes, then drain.
    if (socket_) {
      boost::system::error_code ec;
      socket_->close(ec);
    }
    io_.restart();
    io_.run();
    socket_.reset();
    throw RpcError(v1::ERROR_CODE_DEADLINE_EXCEEDED, "no reply from " + opts_.address + " within " +
                                                         std::to_string(timeout.count()) + " ms (" +
                                                         payload_name(request) + ")");
  }
  if (error) {
    socket_.reset();
    try {
      std::rethrow_exception(error);
    } catch (const RpcError&) {
      throw;
    } catch (const std::exception& e) {
      throw RpcError(v1::ERROR_CODE_UNAVAILABLE, "cannot reach " + opts_.address + ": " + e.what());
    }
  }
  if (reply->has_error()) {
    const auto code = reply->error().code();
    if (code == v1::ERROR_CODE_BAD_FRAME || code == v1::ERROR_CODE_UNAUTHENTICATED) socket_.reset();  // server closed it
    throw RpcError(code, reply->error().message());
  }
  return std::move(*reply);
}

}  // namespace moe::rpc
