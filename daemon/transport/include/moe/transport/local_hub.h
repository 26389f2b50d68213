// Point-to-point between ranks that are threads of one process (a daemon's own
// devices), for UcxCommunicator: messages between local ranks are copied once,
// from the sender's buffer straight into the receiver's, and never touch UCX.
// Semantics follow UCX tag matching: FIFO per (source, destination, tag). A send
// that finds its receive posted is copied straight across; otherwise the hub keeps
// a copy and the send completes at once (eager, as UCX does for small messages),
// so blocking sends cannot deadlock on receive order. Completion wakes the owner
// through the file descriptor it attached (an eventfd in its epoll set).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace moe::transport {

class LocalHub {
 public:
  explicit LocalHub(std::vector<int> ranks);
  bool is_local(int rank) const { return ranks_.count(rank) != 0; }

  // state: 0 pending, 1 done. bytes: what the sender sent (a receiver compares it
  // with what it expected).
  struct Completion {
    std::atomic<int> state{0};
    size_t bytes = 0;
  };

  void attach(int rank, int wake_fd);
  void detach(int rank);
  // Called by the thread driving src (post_send) or dst (post_recv). The caller's
  // own op may complete during the call and is not signalled (it polls its ops
  // before it blocks); a completed op of the other party wakes that party.
  void post_send(int src, int dst, uint64_t tag, const void* data, size_t bytes, Completion* c);
  void post_recv(int src, int dst, uint64_t tag, void* data, size_t bytes, Completion* c);
  // Drops `rank`'s posted receives (after a failure, or when it leaves), so nobody
  // writes into its buffers. Its completed sends stay queued for their receivers.
  void withdraw(int rank);
  // (source, destination, tag) queues holding a message or a receive (tests).
  size_t pending() const;
  // A local rank stopped: its peers' waits on it fail. culprit is the rank to blame
  // (the rank itself, or the remote rank whose failure made it stop).
  void abort(int rank, const std::string& reason, int culprit = -1);
  struct Failure {
    std::string reason;
    int culprit;
  };
  std::optional<Failure> failure_of(int rank) const;

 private:
  struct Send {
    std::vector<uint8_t> data;  // the hub's copy
  };
  struct Recv {
    void* data;
    size_t bytes;
    Completion* c;
  };
  using Key = std::tuple<int, int, uint64_t>;  // (src, dst, tag)
  void wake(int rank);

  const std::set<int> ranks_;
  mutable std::mutex mu_;
  std::map<int, int> wake_fd_;
  std::map<Key, std::deque<Send>> sends_;
  std::map<Key, std::deque<Recv>> recvs_;
  std::map<int, Failure> failed_;
};

}  // namespace moe::transport
