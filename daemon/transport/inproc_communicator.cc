#include "moe/transport/inproc_communicator.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>

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
  std::deque<Op> ops;
  std::map<uint64_t, Op> background;  // by transfer id
  uint64_t next_transfer = 1;
  std::vector<float> reduce_parts;  // rank 0's buffer for the other ranks' parts

  void check_usable() const {
    if (broken) throw TransportError(broken_peer, "communicator unusable after an earlier failure: " + broken_reason);
  }

  void check_peer(int peer, const char* what) const {
    MOE_CHECK(peer >= 0 && peer < size && peer != rank, what, ": peer ", peer, " out of range or self");
  }

  void post_send(Op& op, int peer, const void* buf, size_t bytes, uint64_t tag) {
    op.peer = peer;
    op.bytes = bytes;
    hub->post_send(rank, peer, tag, buf, bytes, &op.done);
  }
  void post_recv(Op& op, int peer, void* buf, size_t bytes, uint64_t tag) {
    op.peer = peer;
    op.is_recv = true;
    op.bytes = bytes;
    hub->post_recv(peer, rank, tag, buf, bytes, &op.done);
  }
  void send(int peer, const void* buf, size_t bytes, uint64_t tag, const char* what) {
    check_peer(peer, what);
    post_send(ops.emplace_back(), peer, buf, bytes, tag);
  }
  void recv(int peer, void* buf, size_t bytes, uint64_t tag, const char* what) {
    check_peer(peer, what);
    post_recv(ops.emplace_back(), peer, buf, bytes, tag);
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

  // One 1-byte message each way on every pair: barrier().
  void token_round(Deadline deadline, const char* what) {
    const uint64_t round_seq = seq++;
    uint8_t token = 1;
    std::vector<uint8_t> got(size);
    for (int r = 0; r < size; ++r)
      if (r != rank) recv(r, &got[r], 1, make_tag(TagKind::kBarrier, round_seq, r), what);
    for (int r = 0; r < size; ++r)
      if (r != rank) send(r, &token, 1, make_tag(TagKind::kBarrier, round_seq, rank), what);
    wait_all(deadline, what);
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
  Impl& m = *impl_;
  m.check_usable();
  for (const AllToAllBuffer& b : buffers) {
    check_segments(b, size_);
    MOE_CHECK(b.send_segs->bytes[rank_] == b.recv_segs->bytes[rank_], "all_to_all_v: self segment sizes differ (",
              b.send_segs->bytes[rank_], " vs ", b.recv_segs->bytes[rank_], ")");
  }
  // As UcxCommunicator: one sequence number per buffer, receives posted first
  // (a send that finds its receive is copied straight across), sends in ring order.
  const uint64_t seq0 = m.seq;
  m.seq += buffers.size();
  for (size_t i = 0; i < buffers.size(); ++i) {
    const AllToAllBuffer& b = buffers[i];
    auto* out = static_cast<uint8_t*>(b.recv);
    for (int r = 0; r < size_; ++r)
      if (r != rank_ && b.recv_segs->bytes[r])
        m.recv(r, out + b.recv_segs->offset[r], b.recv_segs->bytes[r], make_tag(TagKind::kAllToAll, seq0 + i, r),
               "all_to_all_v");
  }
  for (int step = 1; step < size_; ++step) {
    const int r = (rank_ + step) % size_;
    for (size_t i = 0; i < buffers.size(); ++i) {
      const AllToAllBuffer& b = buffers[i];
      if (b.send_segs->bytes[r])
        m.send(r, static_cast<const uint8_t*>(b.send) + b.send_segs->offset[r], b.send_segs->bytes[r],
               make_tag(TagKind::kAllToAll, seq0 + i, rank_), "all_to_all_v");
    }
  }
  for (const AllToAllBuffer& b : buffers)
    if (b.send_segs->bytes[rank_])
      std::memcpy(static_cast<uint8_t*>(b.recv) + b.recv_segs->offset[rank_],
                  static_cast<const uint8_t*>(b.send) + b.send_segs->offset[rank_], b.send_segs->bytes[rank_]);
  m.wait_all(deadline, "all_to_all_v");
}

// Reduce to rank 0 in rank order, then rank 0 sends the sum to everyone: every
// rank ends with the same bits, summed 0 + 1 + ... + (R-1), as over UCX.
void InProcCommunicator::all_reduce_sum(float* data, size_t count, Deadline deadline) {
  Impl& m = *impl_;
  m.check_usable();
  const uint64_t seq = m.seq++;
  const size_t bytes = count * sizeof(float);
  if (size_ == 1 || count == 0) return;
  if (rank_ == 0) {
    std::vector<float>& parts = m.reduce_parts;
    parts.resize((size_ - 1) * count);
    for (int r = 1; r < size_; ++r)
      m.recv(r, parts.data() + (r - 1) * count, bytes, make_tag(TagKind::kReduce, seq, r), "all_reduce");
    m.wait_all(deadline, "all_reduce");
    for (int r = 1; r < size_; ++r) {
      const float* p = parts.data() + (r - 1) * count;
      for (size_t i = 0; i < count; ++i) data[i] += p[i];
    }
    for (int r = 1; r < size_; ++r) m.send(r, data, bytes, make_tag(TagKind::kBroadcast, seq, 0), "all_reduce");
    m.wait_all(deadline, "all_reduce");
  } else {
    m.send(0, data, bytes, make_tag(TagKind::kReduce, seq, rank_), "all_reduce");
    m.wait_all(deadline, "all_reduce");
    m.recv(0, data, bytes, make_tag(TagKind::kBroadcast, seq, 0), "all_reduce");
    m.wait_all(deadline, "all_reduce");
  }
}

void InProcCommunicator::barrier(Deadline deadline) {
  impl_->check_usable();
  impl_->token_round(deadline, "barrier");
}

void InProcCommunicator::send(int peer, const void* data, size_t bytes, uint32_t tag, Deadline deadline) {
  Impl& m = *impl_;
  m.check_usable();
  m.send(peer, data, bytes, make_tag(TagKind::kP2P, tag, rank_), "send");
  m.wait_all(deadline, "send");
}

void InProcCommunicator::recv(int peer, void* data, size_t bytes, uint32_t tag, Deadline deadline) {
  Impl& m = *impl_;
  m.check_usable();
  m.recv(peer, data, bytes, make_tag(TagKind::kP2P, tag, peer), "recv");
  m.wait_all(deadline, "recv");
}

Communicator::TransferId InProcCommunicator::isend(int peer, const void* data, size_t bytes, uint32_t tag,
                                                   std::shared_ptr<const void> keep) {
  Impl& m = *impl_;
  m.check_usable();
  m.check_peer(peer, "isend");
  const uint64_t id = m.next_transfer++;
  Impl::Op& op = m.background[id];
  op.keep = std::move(keep);
  m.post_send(op, peer, data, bytes, make_tag(TagKind::kBackground, tag, rank_));
  return id;
}

Communicator::TransferId InProcCommunicator::irecv(int peer, void* data, size_t bytes, uint32_t tag,
                                                   std::shared_ptr<const void> keep) {
  Impl& m = *impl_;
  m.check_usable();
  m.check_peer(peer, "irecv");
  const uint64_t id = m.next_transfer++;
  Impl::Op& op = m.background[id];
  op.keep = std::move(keep);
  m.post_recv(op, peer, data, bytes, make_tag(TagKind::kBackground, tag, peer));
  return id;
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
