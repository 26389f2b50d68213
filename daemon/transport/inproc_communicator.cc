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

#include "op_book.h"
#include "p2p_collectives.h"
#include "tags.h"

namespace moe::transport {

namespace {
// One posted message.
struct InProcOp {
  int peer = -1;
  bool is_recv = false;
  size_t bytes = 0;
  LocalHub::Completion done;  // written by the hub from the sender's thread
  std::shared_ptr<const void> keep;  // a background transfer's buffer owner
};
}  // namespace

struct InProcCommunicator::Impl : detail::OpBook<InProcCommunicator::Impl, InProcOp> {
  using Op = InProcOp;
  std::shared_ptr<LocalHub> hub;
  int rank = 0, size = 1;
  int wake_fd = -1;

  void check_usable() {
    if (broken) throw_broken();
    check_aborted();
  }

  void check_aborted() {
    if (aborted.load(std::memory_order_acquire)) fail(-1, "aborted: " + aborted_why());
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
  // The hub forgets our receives, our siblings learn we stopped (blaming
  // `peer`), and every later call throws.
  [[noreturn]] void fail(int peer, const std::string& msg) {
    hub->withdraw(rank);
    hub->abort(rank, msg, peer >= 0 ? peer : rank);
    ops.clear();
    mark_broken(peer, msg);
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

  bool settled_background(const Op& op, const char* what) { return settled(op, what); }

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
  impl_->send(rank_, peer, data, bytes, tag, deadline);
}

void InProcCommunicator::recv(int peer, void* data, size_t bytes, uint32_t tag, Deadline deadline) {
  impl_->recv(peer, data, bytes, tag, deadline);
}

Communicator::TransferId InProcCommunicator::isend(int peer, const void* data, size_t bytes, uint32_t tag,
                                                   std::shared_ptr<const void> keep) {
  return impl_->isend(rank_, peer, data, bytes, tag, std::move(keep));
}

Communicator::TransferId InProcCommunicator::irecv(int peer, void* data, size_t bytes, uint32_t tag,
                                                   std::shared_ptr<const void> keep) {
  return impl_->irecv(peer, data, bytes, tag, std::move(keep));
}

bool InProcCommunicator::test(TransferId id) { return impl_->test(id); }

void InProcCommunicator::abort(const std::string& why) {
  if (!impl_->record_abort(why)) return;
  const uint64_t one = 1;
  (void)!::write(impl_->wake_fd, &one, sizeof one);  // a wait in progress looks again
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
