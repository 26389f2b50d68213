// The framed RPC of the control plane over TCP (DESIGN 5): RpcServer serves one
// request at a time per connection with a coroutine handler; RpcClient makes
// blocking calls with a deadline. Both check the cluster token on every
// connection (the first frame is Hello) and enforce the frame size limit.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "moe/rpc/asio.h"
#include "moe/rpc/frame.h"

namespace moe::rpc {

// "HOST:PORT" -> parts; throws RpcError(INVALID_ARGUMENT) naming the text.
std::pair<std::string, int> split_address(const std::string& address);
// The token in a file (surrounding whitespace removed); throws naming the file.
std::string read_token_file(const std::string& path);

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;           // 0: an ephemeral port (see RpcServer::port)
  std::string token;      // empty: no authentication
  std::string role;       // told to clients in HelloReply
  size_t max_frame_bytes = kDefaultMaxFrameBytes;

  // listen is HOST:PORT; throws RpcError naming it when malformed.
  static ServerOptions make(const std::string& listen, std::string token, std::string role) {
    const auto [h, p] = split_address(listen);
    ServerOptions o;
    o.host = h;
    o.port = p;
    o.token = std::move(token);
    o.role = std::move(role);
    return o;
  }
};

// What a handler knows about the request it serves.
struct RequestContext {
  std::string peer;        // "ip:port"
  std::string client_role;
  std::string client_name;
  // From the request's deadline_ms (or a default), less a margin so the reply
  // reaches the caller before it gives up.
  asio::steady_timer::time_point deadline;
};

// A handler returns the reply payload (request_id is filled in by the server).
// Throw RpcError for an error reply; anything else becomes INTERNAL.
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

 private:
  struct Connection;
  awaitable<void> accept_loop();
  awaitable<void> serve(std::shared_ptr<Connection> conn);

  asio::io_context& io_;
  ServerOptions opts_;
  Handler handler_;
  asio::ip::tcp::acceptor acceptor_;
  int port_ = 0;
  std::set<std::shared_ptr<Connection>> connections_;
  bool stopped_ = false;
};

struct ClientOptions {
  std::string address;  // HOST:PORT
  std::string token;
  std::string role;     // told to the server in Hello
  std::string name;
  size_t max_frame_bytes = kDefaultMaxFrameBytes;

  static ClientOptions make(std::string address, std::string token, std::string role, std::string name) {
    ClientOptions o;
    o.address = std::move(address);
    o.token = std::move(token);
    o.role = std::move(role);
    o.name = std::move(name);
    return o;
  }
};

// Thread-safe; one call at a time on one connection, reconnecting after a failure.
class RpcClient {
 public:
  explicit RpcClient(ClientOptions options);
  ~RpcClient();
  // Sends `request` (any payload) and returns the reply payload. Throws RpcError:
  // the server's error, or UNAVAILABLE / DEADLINE_EXCEEDED naming the address.
  v1::Envelope call(v1::Envelope request, std::chrono::milliseconds timeout);
  const std::string& address() const { return opts_.address; }

 private:
  awaitable<void> connect_and_hello();
  awaitable<v1::Envelope> roundtrip(const v1::Envelope& request);
  ClientOptions opts_;
  std::mutex mu_;
  asio::io_context io_;
  std::unique_ptr<asio::ip::tcp::socket> socket_;
  uint64_t next_id_ = 1;
};

}  // namespace moe::rpc
