// The framed RPC: calls and replies, the token on every connection, malformed and
// oversized frames (an error reply, a closed connection, a server that keeps
// serving), deadlines, and an unreachable server.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <fstream>
#include <functional>
#include <future>
#include <thread>

#include "moe/rpc/server.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;
using rpc::RpcError;

// A server on its own io thread: get_job echoes the id; wait_job waits on an
// AsyncEvent until "release" is called or its deadline passes.
class TestServer {
 public:
  explicit TestServer(const std::string& token = "", size_t max_frame = rpc::kDefaultMaxFrameBytes,
                      const std::function<void(rpc::ServerOptions&)>& tune = {})
      : event_(io_) {
    rpc::ServerOptions o;
    o.token = token;
    o.role = "test";
    o.max_frame_bytes = max_frame;
    if (tune) tune(o);
    server_ = std::make_unique<rpc::RpcServer>(
        io_, o, [this](const v1::Envelope& req, const rpc::RequestContext& ctx) -> rpc::awaitable<v1::Envelope> {
          v1::Envelope reply;
          if (req.has_get_job()) {
            if (req.get_job().job_id() == "missing") throw RpcError(v1::ERROR_CODE_NOT_FOUND, "no job 'missing'");
            reply.mutable_job()->set_job_id(req.get_job().job_id());
          } else if (req.has_wait_job()) {
            while (!released_ && std::chrono::steady_clock::now() < ctx.deadline) {
              ++waiting_;
              co_await event_.wait(ctx.deadline);
            }
            reply.mutable_job()->set_job_id(released_ ? "released" : "timeout");
          } else if (req.has_list_jobs()) {  // a handler that ignores the deadline
            rpc::asio::steady_timer t(io_, 2s);
            co_await t.async_wait(rpc::use_awaitable);
            reply.mutable_list_jobs_reply();
          } else {
            throw RpcError(v1::ERROR_CODE_INVALID_ARGUMENT, "unexpected " + rpc::payload_name(req));
          }
          co_return reply;
        });
    thread_ = std::thread([this] {
      auto guard = rpc::asio::make_work_guard(io_);
      io_.run();
    });
  }
  ~TestServer() {
    rpc::asio::post(io_, [this] { server_->stop(); });
    io_.stop();
    thread_.join();
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(server_->port()); }
  int port() const { return server_->port(); }
  int waiting() const { return waiting_.load(); }
  // RpcServer::unauthenticated, read on the server's io thread.
  size_t unauthenticated() {
    std::promise<size_t> n;
    rpc::asio::post(io_, [&] { n.set_value(server_->unauthenticated()); });
    return n.get_future().get();
  }
  void release() {
    rpc::asio::post(io_, [this] {
      released_ = true;
      event_.notify_all();
    });
  }

 private:
  rpc::asio::io_context io_;
  rpc::AsyncEvent event_;
  std::unique_ptr<rpc::RpcServer> server_;
  std::thread thread_;
  bool released_ = false;
  std::atomic<int> waiting_{0};
};

v1::Envelope get_job(const std::string& id) {
  v1::Envelope e;
  e.mutable_get_job()->set_job_id(id);
  return e;
}

rpc::RpcClient client(const std::string& address, const std::string& token = "") {
  return rpc::RpcClient(rpc::ClientOptions::make(address, token, "test-client", "test"));
}

// A raw TCP connection for sending arbitrary bytes.
struct RawSocket {
  int fd;
  explicit RawSocket(int port) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~RawSocket() { ::close(fd); }
  void send_bytes(const std::string& b) { ASSERT_EQ(::send(fd, b.data(), b.size(), MSG_NOSIGNAL), static_cast<ssize_t>(b.size())); }
  // Reads one frame; returns the envelope (or an empty one when the peer closed).
  v1::Envelope read_frame() {
    uint8_t h[4];
    if (!read_exact(h, 4)) return {};
    std::string body(rpc::decode_length(h), '\0');
    if (!read_exact(reinterpret_cast<uint8_t*>(body.data()), body.size())) return {};
    return rpc::decode_body(reinterpret_cast<const uint8_t*>(body.data()), body.size());
  }
  bool closed_by_peer() {
    char c;
    return ::recv(fd, &c, 1, 0) == 0;
  }
  // Nothing to read and not closed: the peer holds the connection open.
  bool still_open() {
    char c;
    return ::recv(fd, &c, 1, MSG_DONTWAIT) < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  }
  bool read_exact(uint8_t* p, size_t n) {
    while (n) {
      const ssize_t r = ::recv(fd, p, n, 0);
      if (r <= 0) return false;
      p += r;
      n -= r;
    }
    return true;
  }
};

std::string hello_frame(const std::string& token) {
  v1::Envelope h;
  h.mutable_hello()->set_token(token);
  return rpc::encode_frame(h);
}

TEST(Rpc, CallsAndErrorReplies) {
  TestServer server;
  auto c = client(server.address());
  EXPECT_EQ(c.call(get_job("j1"), 5s).job().job_id(), "j1");
  EXPECT_EQ(c.call(get_job("j2"), 5s).job().job_id(), "j2");
  try {
    c.call(get_job("missing"), 5s);
    FAIL() << "no error";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), v1::ERROR_CODE_NOT_FOUND);
    EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos);
  }
  EXPECT_EQ(c.call(get_job("j3"), 5s).job().job_id(), "j3");  // the connection survives an error reply
}

TEST(Rpc, TokenIsCheckedOnEveryConnection) {
  TestServer server("s3cret");
  EXPECT_EQ(client(server.address(), "s3cret").call(get_job("a"), 5s).job().job_id(), "a");
  try {
    client(server.address(), "wrong").call(get_job("a"), 5s);
    FAIL() << "accepted a bad token";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), v1::ERROR_CODE_UNAUTHENTICATED);
  }
  // A raw connection that skips hello gets an error and a closed connection.
  RawSocket raw(server.port());
  raw.send_bytes(rpc::encode_frame(get_job("x")));
  const v1::Envelope reply = raw.read_frame();
  EXPECT_EQ(reply.error().code(), v1::ERROR_CODE_UNAUTHENTICATED);
  EXPECT_TRUE(raw.closed_by_peer());
}

TEST(Rpc, MalformedAndOversizedFramesCloseOnlyTheirConnection) {
  TestServer server("", 1024);
  auto good = client(server.address());
  EXPECT_EQ(good.call(get_job("before"), 5s).job().job_id(), "before");
  {
    RawSocket raw(server.port());
    raw.send_bytes(hello_frame(""));
    EXPECT_TRUE(raw.read_frame().has_hello_reply());
    raw.send_bytes(std::string("\x00\x00\x00\x05", 4) + "\xff\xff\xff\xff\xff");  // not an Envelope
    const v1::Envelope reply = raw.read_frame();
    EXPECT_EQ(reply.error().code(), v1::ERROR_CODE_BAD_FRAME);
    EXPECT_TRUE(raw.closed_by_peer());
  }
  {
    RawSocket raw(server.port());
    raw.send_bytes(hello_frame(""));
    EXPECT_TRUE(raw.read_frame().has_hello_reply());
    raw.send_bytes(std::string("\x7f\x00\x00\x00", 4));  // a 2 GiB frame announced
    const v1::Envelope reply = raw.read_frame();
    EXPECT_EQ(reply.error().code(), v1::ERROR_CODE_BAD_FRAME);
    EXPECT_NE(reply.error().message().find("exceeds the limit of 1024"), std::string::npos) << reply.error().message();
    EXPECT_TRUE(raw.closed_by_peer());
  }
  {
    RawSocket raw(server.port());
    raw.send_bytes(std::string("\x00\x00\x00\x00", 4));  // an empty envelope: no payload
    EXPECT_EQ(raw.read_frame().error().code(), v1::ERROR_CODE_BAD_FRAME);
  }
  EXPECT_EQ(good.call(get_job("after"), 5s).job().job_id(), "after");  // still serving
}

// Before Hello (docs/control-plane.md#before-authentication): a stranger's frame
// is small, its time is short, and strangers hold few connections at once.
TEST(Rpc, BeforeHelloFramesAreSmallTimeIsShortAndStrangersFew) {
  TestServer server("s3cret", rpc::kDefaultMaxFrameBytes, [](rpc::ServerOptions& o) {
    o.hello_timeout = 2s;
    o.max_unauthenticated = 4;
  });
  {  // a 16 MiB frame announced before Hello: refused, nothing allocated for it
    RawSocket raw(server.port());
    raw.send_bytes(std::string("\x01\x00\x00\x00", 4));
    const v1::Envelope reply = raw.read_frame();
    EXPECT_EQ(reply.error().code(), v1::ERROR_CODE_BAD_FRAME);
    EXPECT_NE(reply.error().message().find("exceeds the limit of 4096 before hello"), std::string::npos)
        << reply.error().message();
    EXPECT_TRUE(raw.closed_by_peer());
  }
  // Four strangers that say nothing fill the slots; a client that speaks gets in
  // at once, closing the oldest stranger.
  std::vector<std::unique_ptr<RawSocket>> silent;
  for (int i = 0; i < 4; ++i) silent.push_back(std::make_unique<RawSocket>(server.port()));
  for (auto until = std::chrono::steady_clock::now() + 2s; server.unauthenticated() < 4;)
    ASSERT_LT(std::chrono::steady_clock::now(), until) << "the server did not accept the four";
  EXPECT_EQ(client(server.address(), "s3cret").call(get_job("in"), 5s).job().job_id(), "in");
  EXPECT_TRUE(silent[0]->closed_by_peer());
  EXPECT_TRUE(silent[1]->still_open()) << "closed at the deadline, not for room";
  // The others are closed at their Hello deadline (2 s; a read waits up to 5 s).
  for (size_t i = 1; i < silent.size(); ++i) EXPECT_TRUE(silent[i]->closed_by_peer());
  EXPECT_EQ(server.unauthenticated(), 0u);
}

TEST(Rpc, AnEmptyTokenFileIsRefusedNotTakenAsNoToken) {
  const std::string path = ::testing::TempDir() + "/empty_token";
  { std::ofstream(path) << " \n"; }
  try {
    rpc::read_token_file(path);
    FAIL() << "an empty token file was read as no token";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("token file " + path + " is empty"), std::string::npos) << e.what();
  }
  { std::ofstream(path) << "  abc\n"; }
  EXPECT_EQ(rpc::read_token_file(path), "abc");
}

TEST(Rpc, DeadlinesBoundEveryCall) {
  TestServer server;
  auto c = client(server.address());
  v1::Envelope wait, slow;
  wait.mutable_wait_job()->set_job_id("w");
  slow.mutable_list_jobs();
  try {
    c.call(slow, 300ms);  // the handler takes 2 s: the client's deadline ends the call
    FAIL() << "no deadline";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), v1::ERROR_CODE_DEADLINE_EXCEEDED);
    EXPECT_NE(std::string(e.what()).find("within 300 ms"), std::string::npos) << e.what();
  }
  EXPECT_EQ(c.call(get_job("next"), 5s).job().job_id(), "next");  // a fresh connection after the timeout
  // The server's own wait ends at the request's deadline: it answers "timeout".
  EXPECT_EQ(c.call(wait, 2s).job().job_id(), "timeout") << "server-side deadline is the request's";
  // A waiter is woken by the event long before its deadline.
  const int before = server.waiting();
  std::thread releaser([&] {
    while (server.waiting() == before) std::this_thread::yield();  // the call below is waiting
    server.release();
  });
  EXPECT_EQ(c.call(wait, 20s).job().job_id(), "released");
  releaser.join();
}

TEST(Rpc, UnreachableServerIsUnavailable) {
  int port;
  {
    TestServer gone;
    port = gone.port();
  }
  auto c = client("127.0.0.1:" + std::to_string(port));
  try {
    c.call(get_job("a"), 2s);
    FAIL() << "reached a stopped server";
  } catch (const RpcError& e) {
    EXPECT_TRUE(e.code() == v1::ERROR_CODE_UNAVAILABLE || e.code() == v1::ERROR_CODE_DEADLINE_EXCEEDED) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(port)), std::string::npos) << e.what();
  }
  EXPECT_THROW(client("no-port-here"), moe::InvalidArgument);
}

}  // namespace
}  // namespace moe::test
