#include "moe/http/metrics_endpoint.h"
#include "moe/http/request_head.h"

#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <chrono>
#include <thread>

#include <unistd.h>

#include "moe/rpc/asio.h"
#include "moe/rpc/client.h"

namespace moe::http {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

namespace {

constexpr size_t kMaxRequestHeader = 8192;
constexpr auto kRequestTimeout = std::chrono::seconds(10);

// One scrape: read the request head, answer, close.
struct Connection : std::enable_shared_from_this<Connection> {
  Connection(tcp::socket s, const prometheus::Registry& r)
      : socket(std::move(s)), timer(socket.get_executor()), request(kMaxRequestHeader), registry(r) {}

  void start() {
    auto self = shared_from_this();
    // A client that never finishes its request is dropped, not kept forever.
    timer.expires_after(kRequestTimeout);
    timer.async_wait([self](error_code ec) {
      if (!ec) self->close();
    });
    asio::async_read_until(socket, request, "\r\n\r\n", [self](error_code ec, size_t) {
      if (ec) return self->close();  // gone, or a head over kMaxRequestHeader
      self->respond();
    });
  }

  void respond() {
    const std::string head(asio::buffers_begin(request.data()), asio::buffers_end(request.data()));
    const Answer a = answer_for(head);
    const bool with_body = head.rfind("HEAD ", 0) != 0;
    // /healthz: the process serves (liveness for probes; docs/metrics.md#health).
    const std::string body = a.status != 200       ? a.reason + "\n"
                             : a.path == "/healthz" ? std::string("ok\n")
                                                    : prometheus::TextSerializer().Serialize(registry.Collect());
    response = "HTTP/1.1 " + std::to_string(a.status) + " " + a.reason +
               "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: " +
               std::to_string(body.size()) + (a.status == 405 ? "\r\nAllow: GET, HEAD" : "") +
               "\r\nConnection: close\r\n\r\n" + (with_body ? body : "");
    auto self = shared_from_this();
    asio::async_write(socket, asio::buffer(response), [self](error_code, size_t) { self->close(); });
  }

  void close() {
    error_code ignored;
    timer.cancel();
    socket.shutdown(tcp::socket::shutdown_both, ignored);
    socket.close(ignored);
  }

  tcp::socket socket;
  asio::steady_timer timer;
  asio::streambuf request;
  std::string response;
  const prometheus::Registry& registry;
};

}  // namespace

struct MetricsEndpoint::Impl {
  Impl(const std::string& listen, std::shared_ptr<prometheus::Registry> r) : registry(std::move(r)), acceptor(io) {
    // A bare PORT is loopback's: job names, losses and loads go to other hosts only where asked (HOST:PORT).
    const auto [host, port] = rpc::split_address(listen.find(':') == std::string::npos ? "127.0.0.1:" + listen : listen);
    const tcp::endpoint ep(asio::ip::make_address(host), static_cast<unsigned short>(port));
    acceptor.open(ep.protocol());
    acceptor.set_option(tcp::acceptor::reuse_address(true));
    acceptor.bind(ep);
    acceptor.listen();
    accept();
    thread = std::thread([this] { io.run(); });
  }

  ~Impl() {
    io.stop();
    thread.join();
  }

  void accept() {
    acceptor.async_accept([this](error_code ec, tcp::socket s) {
      if (ec == asio::error::operation_aborted) return;
      if (!ec) std::make_shared<Connection>(std::move(s), *registry)->start();
      accept();  // a failed accept (e.g. the client reset first) does not stop the endpoint
    });
  }

  std::shared_ptr<prometheus::Registry> registry;
  asio::io_context io;
  tcp::acceptor acceptor;
  std::thread thread;
};

MetricsEndpoint::MetricsEndpoint(const std::string& listen, std::shared_ptr<prometheus::Registry> registry)
    : impl_(std::make_unique<Impl>(listen, std::move(registry))) {}

MetricsEndpoint::~MetricsEndpoint() = default;

int MetricsEndpoint::port() const { return impl_->acceptor.local_endpoint().port(); }

std::string MetricsEndpoint::address() const {
  const asio::ip::address host = impl_->acceptor.local_endpoint().address();
  std::string name = host.to_string();
  if (host.is_unspecified()) {  // every interface: the host's name is what a scraper can use
    char buf[256] = {};
    ::gethostname(buf, sizeof buf - 1);
    name = buf;
  }
  return name + ":" + std::to_string(port());
}

}  // namespace moe::http
