#include "moe/transport/inproc_communicator.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>

#include "p2p_collectives.h"
#include "tags.h"

namespace moe::transport {

struct InProcCommunicator::Impl {
  // One posted message; a deque keeps addresses stable (the hub writes the
  // completion of a receive from the sender's thread).
  struct Op {
    int peer = -1;
    bool is_recv = false;
    size_t bytes = 0;
    LocalHub::Completion done;
    std::shared_ptr<const void> keep;  // a background transfer's buffer owner
  };

  std::shared_ptr<LocalHub> hub;
  int rank = 0, size = 1;
  int wake_fd = -1;
  uint64_t seq = 0;  // collective sequence, the same on every rank
  bool broken = false;
  std::string broken_reason;
  int broken_peer = -1;
  // abort() from another thread: the next wait (or call) fails with the reason.
  std::atomic<bool> aborted{false};
  std::mutex abort_mu;
  std::string abort_reason;  // guarded by abort_mu
  std::deque<Op> ops;
  std::map<uint64_t, Op> background;  // by transfer id
  uint64_t next_transfer = 1;
  std::vector<float> reduce_parts;  // rank 0's buffer for the other ranks' parts

  void check_usable() {
    if (broken) throw TransportError(broken_peer, "communicator unusable after an earlier failure: " + broken_reason);
    check_aborted();
  }

  void check_aborted() {
    if (!aborted.load(std::memory_order_acquire)) return;
    std::string why;
    {
      std::lock_guard<std::mutex> lock(abort_mu);
      why = abort_reason;
    }
    fail(-1, "aborted: " + why);
  }

  void check_peer(int peer, const char* what) const {
    MOE_CHECK(peer >= 0 && peer < size && peer != rank, what, ": peer ", peer, " out of range or self");
  }

  void start_send(Op& op, int peer, const void* buf, size_t bytes, uint64_t tag) {
    op.peer = peer;
    op.bytes = bytes;
    hub->post_send(rank, peer, tag, buf, bytes, &op.done);
  }
  void start_recv(Op& op, int peer, void* buf, size_t bytes, uint64_t tag) {
    op.peer = peer;
    op.is_recv = true;
    op.bytes = bytes;
    hub->post_recv(peer, rank, tag, buf, bytes, &op.done);
  }
  // The ops of p2p_collectives.h.
  void post_send(int peer, const void* buf, size_t bytes, uint64_t tag, const char* what) {
    check_peer(peer, what);
    start_send(ops.emplace_back(), peer, buf, bytes, tag);
  }
  void post_recv(int peer, void* buf, size_t bytes, uint64_t tag, const char* what) {
    check_peer(peer, what);
    start_recv(ops.emplace_back(), peer, buf, bytes, tag);
  }

  // A background transfer's op, completed in test(); it holds `keep` (the
  // buffer's owner) until then.
  std::pair<uint64_t, Op*> new_background(int peer, const char* what, std::shared_ptr<const void> keep) {
    check_usable();
    check_peer(peer, what);
    const uint64_t id = next_transfer++;
    Op& op = background[id];
    op.keep = std::move(keep);
    return {id, &op};
  }

  // The hub forgets our receives, our siblings learn we stopped (blaming
  // `peer`), and every later call throws.
  [[noreturn]] void fail(int peer, const std::string& msg) {
    hub->withdraw(rank);
    hub->abort(rank, msg, peer >= 0 ? peer : rank);
    ops.clear();
    broken = true;
    broken_reason = msg;
    broken_peer = peer;
    throw TransportError(peer, msg);
  }

  // Throws when op completed badly (a size mismatch) or its peer stopped; true
  // once it completed.
  bool settled(const Op& op, const char* what) {
    check_aborted();
    if (op.done.state.load(std::memory_order_acquire) != 0) {
      if (op.is_recv && op.done.bytes != op.bytes)
        fail(op.peer, std::string(what) + ": rank " + std::to_string(op.peer) + " sent " +
                          std::to_string(op.done.bytes) + " bytes, expected " + std::to_string(op.bytes));
      return true;
    }
    if (const auto why = hub->failure_of(op.peer))
      fail(why->culprit, std::string(what) + ": rank " + std::to_string(op.peer) + " failed (" + why->reason + ")");
    return false;
  }

  // Waits for every posted op; throws naming the peer on failure or deadline.
  void wait_all(Deadline deadline, const char* what) {
    check_aborted();
    for (;;) {
      bool all_done = true;
      for (const Op& op : ops) all_done &= settled(op, what);
      if (all_done) {
        ops.clear();
        return;
      }
      const auto now = Clock::now();
      if (now >= deadline) {
        const auto late = std::find_if(ops.begin(), ops.end(), [](const Op& op) { return op.done.state.load() == 0; });
        fail(late->peer, std::string(what) + ": timed out waiting for rank " + std::to_string(late->peer));
      }
      // The hub signals our eventfd when a peer completes one of our ops or a
      // rank fails; the ops themselves say what happened.
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
      pollfd p{wake_fd, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left, 1, 1000))) > 0) {
        uint64_t n;
        (void)!::read(wake_fd, &n, sizeof n);
      }
    }
  }
};

InProcCommunicator::InProcCommunicator(std::shared_ptr<LocalHub> hub, int rank, int size)
    : impl_(std::make_unique<Impl>()), rank_(rank), size_(size) {
  MOE_CHECK(hub && size >= 1 && size < (1 << 16) && rank >= 0 && rank < size, "inproc: bad rank ", rank, " of ",
            size);
  for (int r = 0; r < size; ++r) MOE_CHECK(hub->is_local(r), "inproc: rank ", r, " is not in the hub");
  Impl& m = *impl_;
  m.hub = std::move(hub);
  m.rank = rank;
  m.size = size;
  m.wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  MOE_CHECK(m.wake_fd >= 0, "inproc: eventfd: ", std::strerror(errno));
  m.hub->attach(rank, m.wake_fd);
}

InProcCommunicator::~InProcCommunicator() {
  Impl& m = *impl_;
  m.hub->withdraw(rank_);  // nobody writes into our receive buffers from now on
  m.hub->detach(rank_);
  ::close(m.wake_fd);
}

void InProcCommunicator::all_to_all_v(const std::vector<AllToAllBuffer>& buffers, Deadline deadline) {
  impl_->check_usable();
  detail::all_to_all_v(*impl_, rank_, size_, buffers, deadline);
}

void InProcCommunicator::all_reduce_sum(float* data, size_t count, Deadline deadline) {
  impl_->check_usable();
  detail::all_reduce_sum(*impl_, rank_, size_, data, count, deadline, impl_->reduce_parts);
}

void InProcCommunicator::barrier(Deadline deadline) {
  impl_->check_usable();
  detail::token_round(*impl_, rank_, size_, TagKind::kBarrier, deadline, "barrier");
}

void InProcCommunicator::send(int peer, const void* data, size_t bytes, uint32_t tag, Deadline deadline) {
  Impl& m = *impl_;
  m.check_usable();
  m.post_send(peer, data, bytes, make_tag(TagKind::kP2P, tag, rank_), "send");
  m.wait_all(deadline, "send");
}

void InProcCommunicator::recv(int peer, void* data, size_t bytes, uint32_t tag, Deadline deadline) {
  Impl& m = *impl_;
  m.check_usable();
  m.post_recv(peer, data, bytes, make_tag(TagKind::kP2P, tag, peer), "recv");
  m.wait_all(deadline, "recv");
}

Communicator::TransferId InProcCommunicator::isend(int peer, const void* data, size_t bytes, uint32_t tag,
                                                   std::shared_ptr<const void> keep) {
  const auto [id, op] = impl_->new_background(peer, "isend", std::move(keep));
  impl_->start_send(*op, peer, data, bytes, make_tag(TagKind::kBackground, tag, rank_));
  return id;
}

Communicator::TransferId InProcCommunicator::irecv(int peer, void* data, size_t bytes, uint32_t tag,
                                                   std::shared_ptr<const void> keep) {
  const auto [id, op] = impl_->new_background(peer, "irecv", std::move(keep));
  impl_->start_recv(*op, peer, data, bytes, make_tag(TagKind::kBackground, tag, peer));
  return id;
}

void InProcCommunicator::abort(const std::string& why) {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.abort_mu);
    m.abort_reason = why;
  }
  m.aborted.store(true, std::memory_order_release);
  const uint64_t one = 1;
  (void)!::write(m.wake_fd, &one, sizeof one);  // a wait in progress looks again
}

bool InProcCommunicator::test(TransferId id) {
  Impl& m = *impl_;
  m.check_usable();
  const auto it = m.background.find(id);
  MOE_CHECK(it != m.background.end(), "test: no transfer ", id);
  if (!m.settled(it->second, it->second.is_recv ? "irecv" : "isend")) return false;
  m.background.erase(it);
  return true;
}

InProcGroup::InProcGroup(int size) : size_(size) {
  MOE_CHECK(size >= 1, "in-process group size must be >= 1, got ", size);
  std::vector<int> ranks(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  hub_ = std::make_shared<LocalHub>(ranks);
}

std::unique_ptr<Communicator> InProcGroup::communicator(int rank) {
  MOE_CHECK(rank >= 0 && rank < size_, "rank ", rank, " out of range [0, ", size_, ")");
  return std::make_unique<InProcCommunicator>(hub_, rank, size_);
}

void InProcGroup::abort(int rank, const std::string& reason) { hub_->abort(rank, reason); }

}  // namespace moe::transport
