// What the two tag-matched host communicators (InProcCommunicator, UcxCommunicator)
// keep about their posted ops, and the calls built on it, written once. Private to
// daemon/transport. Impl derives from OpBook<Impl, Op> (CRTP) and provides:
//   void check_usable();                                    // throws once broken or aborted
//   void check_peer(int peer, const char* what);            // throws for a bad or failed peer
//   void start_send(Op&, int peer, const void*, size_t, uint64_t tag);
//   void start_recv(Op&, int peer, void*, size_t, uint64_t tag);
//   void wait_all(Deadline, const char* what);              // every op of `ops`, or throw
//   bool settled_background(Op&, const char* what);          // done (true), pending, or throw
// Op has `peer`, `is_recv` and `keep` (a background transfer's buffer owner).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "moe/base/check.h"
#include "moe/transport/communicator.h"
#include "tags.h"

namespace moe::transport::detail {

template <class Impl, class Op>
struct OpBook {
  uint64_t seq = 0;  // collective sequence, the same on every rank
  // The ops of the call in progress; a deque keeps addresses stable (completions
  // are written into an Op from elsewhere).
  std::deque<Op> ops;
  // Background transfers (isend/irecv) by id; map nodes keep their addresses.
  std::map<uint64_t, Op> background;
  uint64_t next_transfer = 1;
  std::vector<float> reduce_parts;  // rank 0's buffer for the other ranks' parts in all_reduce_sum
  // Once a call failed, every later call throws this.
  bool broken = false;
  std::string broken_reason;
  int broken_peer = -1;
  // abort() from another thread: the next wait (or call) fails with the first reason given.
  std::atomic<bool> aborted{false};
  mutable std::mutex abort_mu;
  std::string abort_reason;  // guarded by abort_mu

  std::string aborted_why() const {
    std::lock_guard<std::mutex> lock(abort_mu);
    return abort_reason;
  }
  // Keeps the first reason; false if an abort came before.
  bool record_abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(abort_mu);
    if (aborted.load(std::memory_order_relaxed)) return false;
    abort_reason = why;
    aborted.store(true, std::memory_order_release);
    return true;
  }
  void mark_broken(int peer, const std::string& msg) {
    broken = true;
    broken_reason = msg;
    broken_peer = peer;
  }
  [[noreturn]] void throw_broken() const {
    throw TransportError(broken_peer, "communicator unusable after an earlier failure: " + broken_reason);
  }

  // The ops of p2p_collectives.h. The peer is checked before its op exists: a
  // failed peer throws through fail(), which drains every op, and an op never
  // posted has nothing to wait on.
  void post_send(int peer, const void* buf, size_t bytes, uint64_t tag, const char* what) {
    self().check_peer(peer, what);
    self().start_send(ops.emplace_back(), peer, buf, bytes, tag);
  }
  void post_recv(int peer, void* buf, size_t bytes, uint64_t tag, const char* what) {
    self().check_peer(peer, what);
    self().start_recv(ops.emplace_back(), peer, buf, bytes, tag);
  }

  // Communicator::send / recv: one message, waited for.
  void send(int rank, int peer, const void* data, size_t bytes, uint32_t tag, Deadline deadline) {
    self().check_usable();
    post_send(peer, data, bytes, make_tag(TagKind::kP2P, tag, rank), "send");
    self().wait_all(deadline, "send");
  }
  void recv(int peer, void* data, size_t bytes, uint32_t tag, Deadline deadline) {
    self().check_usable();
    post_recv(peer, data, bytes, make_tag(TagKind::kP2P, tag, peer), "recv");
    self().wait_all(deadline, "recv");
  }

  // Communicator::isend / irecv: a background transfer holding `keep` until test() sees it end.
  uint64_t isend(int rank, int peer, const void* data, size_t bytes, uint32_t tag, std::shared_ptr<const void> keep) {
    auto [id, op] = new_background(peer, "isend", std::move(keep));
    self().start_send(*op, peer, data, bytes, make_tag(TagKind::kBackground, tag, rank));
    return id;
  }
  uint64_t irecv(int peer, void* data, size_t bytes, uint32_t tag, std::shared_ptr<const void> keep) {
    auto [id, op] = new_background(peer, "irecv", std::move(keep));
    self().start_recv(*op, peer, data, bytes, make_tag(TagKind::kBackground, tag, peer));
    return id;
  }
  // Communicator::test: true (and forgotten) once the transfer completed.
  bool test(uint64_t id) {
    self().check_usable();
    const auto it = background.find(id);
    MOE_CHECK(it != background.end(), "test: no transfer ", id);
    if (!self().settled_background(it->second, it->second.is_recv ? "irecv" : "isend")) return false;
    background.erase(it);
    return true;
  }

 private:
  Impl& self() { return static_cast<Impl&>(*this); }

  std::pair<uint64_t, Op*> new_background(int peer, const char* what, std::shared_ptr<const void> keep) {
    self().check_usable();
    self().check_peer(peer, what);
    const uint64_t id = next_transfer++;
    Op& op = background[id];
    op.keep = std::move(keep);
    return {id, &op};
  }
};

}  // namespace moe::transport::detail
