// The Prometheus scrape endpoint over real loopback sockets: a scrape, other
// paths and methods, and clients that misbehave.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include "moe/http/metrics_endpoint.h"

namespace moe::test {
namespace {

// A connected loopback socket (5 s receive timeout).
int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

// Sends request and returns everything until the server closes.
std::string exchange(int port, const std::string& request) {
  const int fd = connect_to(port);
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string reply;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) reply.append(buf, n);
  ::close(fd);
  return reply;
}

class MetricsEndpointTest : public ::testing::Test {
 protected:
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  http::MetricsEndpoint endpoint{"127.0.0.1:0", registry};
  void SetUp() override {
    prometheus::BuildCounter().Name("moe_test_total").Help("a test counter").Register(*registry).Add({{"k", "v"}}).Increment(3);
  }
};

TEST_F(MetricsEndpointTest, ServesTheRegistryInTheTextFormat) {
  const std::string reply = exchange(endpoint.port(), "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(reply.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << reply;
  EXPECT_NE(reply.find("# TYPE moe_test_total counter"), std::string::npos) << reply;
  EXPECT_NE(reply.find("moe_test_total{k=\"v\"} 3"), std::string::npos) << reply;
  const size_t body = reply.find("\r\n\r\n") + 4;
  EXPECT_NE(reply.find("Content-Length: " + std::to_string(reply.size() - body) + "\r\n"), std::string::npos) << reply;
}

TEST_F(MetricsEndpointTest, OtherPathsMethodsAndGarbageGetTheirStatus) {
  EXPECT_EQ(exchange(endpoint.port(), "GET / HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404 Not Found", 0), 0u);
  EXPECT_EQ(exchange(endpoint.port(), "GET /metricsx HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 404", 0), 0u);
  const std::string post = exchange(endpoint.port(), "POST /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(post.rfind("HTTP/1.1 405 Method Not Allowed", 0), 0u) << post;
  EXPECT_NE(post.find("\r\nAllow: GET, HEAD\r\n"), std::string::npos) << post;
  EXPECT_EQ(exchange(endpoint.port(), "garbage\r\n\r\n").rfind("HTTP/1.1 400 Bad Request", 0), 0u);
  EXPECT_EQ(exchange(endpoint.port(), "GET /metrics HTTP/2\r\n\r\n").rfind("HTTP/1.1 400", 0), 0u);
  // HEAD: the status and the length of the body, no body.
  const std::string head = exchange(endpoint.port(), "HEAD /metrics?x=1 HTTP/1.0\r\n\r\n");
  EXPECT_EQ(head.rfind("HTTP/1.1 200 OK", 0), 0u) << head;
  EXPECT_EQ(head.substr(head.find("\r\n\r\n") + 4), "") << head;
}

TEST_F(MetricsEndpointTest, HealthzAnswersOkForProbes) {
  const std::string reply = exchange(endpoint.port(), "GET /healthz HTTP/1.1\r\n\r\n");
  EXPECT_EQ(reply.rfind("HTTP/1.1 200 OK", 0), 0u) << reply;
  EXPECT_EQ(reply.substr(reply.find("\r\n\r\n") + 4), "ok\n") << reply;
  EXPECT_EQ(exchange(endpoint.port(), "POST /healthz HTTP/1.1\r\n\r\n").rfind("HTTP/1.1 405", 0), 0u);
}

TEST_F(MetricsEndpointTest, SurvivesOversizedAndUnfinishedRequests) {
  // A head over the limit is dropped without an answer.
  EXPECT_EQ(exchange(endpoint.port(), "GET /metrics HTTP/1.1\r\nX: " + std::string(20000, 'a') + "\r\n\r\n"), "");
  // A client that never finishes its request does not hold up a scrape.
  const int idle = connect_to(endpoint.port());
  ::send(idle, "GET /met", 8, MSG_NOSIGNAL);
  EXPECT_NE(exchange(endpoint.port(), "GET /metrics HTTP/1.0\r\n\r\n").find("moe_test_total"), std::string::npos);
  ::close(idle);
}

TEST(MetricsEndpoint, BadAddressesAreErrors) {
  auto registry = std::make_shared<prometheus::Registry>();
  EXPECT_ANY_THROW(http::MetricsEndpoint("127.0.0.1:notaport", registry));
  http::MetricsEndpoint taken("127.0.0.1:0", registry);
  EXPECT_ANY_THROW(http::MetricsEndpoint("127.0.0.1:" + std::to_string(taken.port()), registry));
}

}  // namespace
}  // namespace moe::test
