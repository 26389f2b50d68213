#include "moe/transport/bootstrap.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "moe/base/check.h"

namespace moe::transport {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kMaxBlob = 1u << 20;

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left > 0 ? static_cast<int>(left) : 0;
}

// Waits for `events` on fd; false on timeout.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) detail::fail("bootstrap: poll failed: ", std::strerror(errno));
  }
}

void write_all(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    MOE_CHECK(wait_fd(fd, POLLOUT, deadline), "bootstrap: timed out sending");
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    MOE_CHECK(w > 0, "bootstrap: send failed: ", std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void read_all(int fd, void* data, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    MOE_CHECK(wait_fd(fd, POLLIN, deadline), "bootstrap: timed out receiving");
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    MOE_CHECK(r > 0, "bootstrap: peer closed the connection");
    p += r;
    n -= static_cast<size_t>(r);
  }
}

void write_u32(int fd, uint32_t v, Clock::time_point deadline) {
  const uint32_t be = htonl(v);
  write_all(fd, &be, 4, deadline);
}

uint32_t read_u32(int fd, Clock::time_point deadline) {
  uint32_t be;
  read_all(fd, &be, 4, deadline);
  return ntohl(be);
}

struct Fd {
  int fd = -1;
  explicit Fd(int f = -1) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd, o.fd);
    return *this;
  }
};

}  // namespace

TcpRendezvousServer::TcpRendezvousServer(int size, std::chrono::milliseconds timeout, const std::string& host)
    : size_(size), timeout_(timeout) {
  MOE_CHECK(size >= 1, "rendezvous: size must be >= 1");
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  MOE_CHECK(listen_fd_ >= 0, "rendezvous: socket: ", std::strerror(errno));
  const int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    ::close(listen_fd_);
    detail::fail("rendezvous: bad IPv4 address '", host, "'");
  }
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(listen_fd_, size) != 0) {
    const std::string err = std::strerror(errno);
    ::close(listen_fd_);
    detail::fail("rendezvous: bind/listen on ", host, ": ", err);
  }
  socklen_t len = sizeof addr;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  thread_ = std::thread([this] { serve(); });
}

TcpRendezvousServer::~TcpRendezvousServer() {
  if (thread_.joinable()) thread_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void TcpRendezvousServer::serve() {
  try {
    const auto deadline = Clock::now() + timeout_;
    std::vector<Fd> clients(size_);
    std::vector<std::string> blobs(size_);
    for (int i = 0; i < size_; ++i) {
      MOE_CHECK(wait_fd(listen_fd_, POLLIN, deadline), "rendezvous: timed out with ", i, " of ", size_,
                " ranks connected");
      Fd c(::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC));
      MOE_CHECK(c.fd >= 0, "rendezvous: accept: ", std::strerror(errno));
      const uint32_t rank = read_u32(c.fd, deadline), size = read_u32(c.fd, deadline);
      const uint32_t len = read_u32(c.fd, deadline);
      MOE_CHECK(size == static_cast<uint32_t>(size_), "rendezvous: a client says size ", size, ", expected ", size_);
      MOE_CHECK(rank < size, "rendezvous: rank ", rank, " out of range [0, ", size_, ")");
      MOE_CHECK(clients[rank].fd < 0, "rendezvous: rank ", rank, " connected twice");
      MOE_CHECK(len <= kMaxBlob, "rendezvous: rank ", rank, " sent a ", len, "-byte blob (limit ", kMaxBlob, ")");
      blobs[rank].resize(len);
      read_all(c.fd, blobs[rank].data(), len, deadline);
      clients[rank] = std::move(c);
    }
    for (auto& c : clients)
      for (const auto& b : blobs) {
        write_u32(c.fd, static_cast<uint32_t>(b.size()), deadline);
        write_all(c.fd, b.data(), b.size(), deadline);
      }
  } catch (const std::exception& e) {
    error_ = e.what();
  }
}

void TcpRendezvousServer::wait() {
  if (thread_.joinable()) thread_.join();
  MOE_CHECK(error_.empty(), error_);
}

TcpBootstrap::TcpBootstrap(std::string host, int port, int rank, int size, std::chrono::milliseconds timeout)
    : host_(std::move(host)), port_(port), rank_(rank), size_(size), timeout_(timeout) {}

std::vector<std::string> TcpBootstrap::all_gather(const std::string& mine) {
  const auto deadline = Clock::now() + timeout_;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int gai = ::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &res);
  MOE_CHECK(gai == 0, "bootstrap: cannot resolve ", host_, ": ", ::gai_strerror(gai));
  Fd fd;
  // The server may not listen yet when ranks start together: retry until the deadline.
  for (;;) {
    fd = Fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (::connect(fd.fd, res->ai_addr, res->ai_addrlen) == 0) break;
    if (Clock::now() >= deadline) {
      ::freeaddrinfo(res);
      detail::fail("bootstrap: cannot connect to ", host_, ":", port_, ": ", std::strerror(errno));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::freeaddrinfo(res);
  write_u32(fd.fd, static_cast<uint32_t>(rank_), deadline);
  write_u32(fd.fd, static_cast<uint32_t>(size_), deadline);
  write_u32(fd.fd, static_cast<uint32_t>(mine.size()), deadline);
  write_all(fd.fd, mine.data(), mine.size(), deadline);
  std::vector<std::string> all(size_);
  for (auto& b : all) {
    const uint32_t len = read_u32(fd.fd, deadline);
    MOE_CHECK(len <= kMaxBlob, "bootstrap: blob of ", len, " bytes exceeds the limit");
    b.resize(len);
    read_all(fd.fd, b.data(), len, deadline);
  }
  return all;
}

RootBlobBootstrap::RootBlobBootstrap(Bootstrap& inner, int rank, std::string root_blob)
    : inner_(inner), rank_(rank), root_blob_(rank == 0 ? std::move(root_blob) : std::string()) {}

std::vector<std::string> RootBlobBootstrap::all_gather(const std::string& mine) {
  MOE_CHECK(mine.size() <= UINT32_MAX, "bootstrap: a blob of ", mine.size(), " bytes");
  const uint32_t len = static_cast<uint32_t>(mine.size());
  std::string framed(reinterpret_cast<const char*>(&len), 4);
  framed += mine;
  framed += root_blob_;
  std::vector<std::string> all = inner_.all_gather(framed);
  for (size_t r = 0; r < all.size(); ++r) {
    std::string& b = all[r];
    uint32_t n = 0;
    MOE_CHECK(b.size() >= 4, "bootstrap: rank ", r, " sent ", b.size(), " bytes, less than a frame header");
    std::memcpy(&n, b.data(), 4);
    MOE_CHECK(b.size() - 4 >= n, "bootstrap: rank ", r, " sent a frame of ", b.size(), " bytes claiming ", n);
    if (r == 0) root_blob_ = b.substr(4 + n);
    b = b.substr(4, n);
  }
  MOE_CHECK(!all.empty(), "bootstrap: no ranks");
  gathered_ = true;
  return all;
}

const std::string& RootBlobBootstrap::root_blob() const {
  MOE_CHECK(gathered_, "bootstrap: rank 0's blob is known only after all_gather");
  return root_blob_;
}

}  // namespace moe::transport
