#include "moe/transport/local_hub.h"

#include <unistd.h>

#include <cstring>

namespace moe::transport {

LocalHub::LocalHub(std::vector<int> ranks) : ranks_(ranks.begin(), ranks.end()) {}

void LocalHub::attach(int rank, int wake_fd) {
  std::lock_guard<std::mutex> lock(mu_);
  wake_fd_[rank] = wake_fd;
}

void LocalHub::detach(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  wake_fd_.erase(rank);
}

void LocalHub::wake(int rank) {
  const auto it = wake_fd_.find(rank);
  if (it == wake_fd_.end()) return;
  const uint64_t one = 1;
  const ssize_t w = ::write(it->second, &one, sizeof one);
  (void)w;  // an eventfd at its limit is already signalled
}

// Copies when the sizes agree; either way both sides complete and the receiver
// learns the sent size (a mismatch is its error to report).
static void deliver(const void* src, size_t src_bytes, void* dst, size_t dst_bytes, LocalHub::Completion* sc,
                    LocalHub::Completion* rc) {
  if (src_bytes == dst_bytes && src_bytes) std::memcpy(dst, src, src_bytes);
  rc->bytes = src_bytes;
  sc->bytes = src_bytes;
  rc->state.store(1, std::memory_order_release);
  sc->state.store(1, std::memory_order_release);
}

// Queues are keyed by (src, dst, tag) and tags carry a sequence number that only
// grows: a key's entry is erased as soon as its queue empties, or the maps grow by
// every message ever sent.
//
// Only the other party is woken: the caller (src of a send, dst of a receive) is
// the thread driving that rank, which sees its op complete when it next polls,
// before it ever blocks.
void LocalHub::post_send(int src, int dst, uint64_t tag, const void* data, size_t bytes, Completion* c) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto waiting = recvs_.find({src, dst, tag});
  if (waiting == recvs_.end()) {
    const auto* p = static_cast<const uint8_t*>(data);
    sends_[{src, dst, tag}].push_back({std::vector<uint8_t>(p, p + bytes)});
    c->bytes = bytes;
    c->state.store(1, std::memory_order_release);
    return;
  }
  const Recv r = waiting->second.front();
  waiting->second.pop_front();
  if (waiting->second.empty()) recvs_.erase(waiting);
  deliver(data, bytes, r.data, r.bytes, c, r.c);
  wake(dst);
}

void LocalHub::post_recv(int src, int dst, uint64_t tag, void* data, size_t bytes, Completion* c) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto waiting = sends_.find({src, dst, tag});
  if (waiting == sends_.end()) {
    recvs_[{src, dst, tag}].push_back({data, bytes, c});
    return;
  }
  Send s = std::move(waiting->second.front());
  waiting->second.pop_front();
  if (waiting->second.empty()) sends_.erase(waiting);
  Completion sent;  // the send completed when it was queued
  deliver(s.data.data(), s.data.size(), data, bytes, &sent, c);
}

void LocalHub::withdraw(int rank) {
  // Only receives point into the rank's memory. Queued sends are the hub's own
  // copies of completed sends: a peer may still receive them after the sender left
  // (a rank that finished its last collective and tore down first).
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(recvs_, [&](const auto& e) { return std::get<1>(e.first) == rank; });
}

size_t LocalHub::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sends_.size() + recvs_.size();
}

void LocalHub::abort(int rank, const std::string& reason, int culprit) {
  std::lock_guard<std::mutex> lock(mu_);
  failed_.emplace(rank, Failure{reason, culprit >= 0 ? culprit : rank});
  for (const auto& [r, fd] : wake_fd_) wake(r);
}

std::optional<LocalHub::Failure> LocalHub::failure_of(int rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = failed_.find(rank);
  if (it == failed_.end()) return std::nullopt;
  return it->second;
}

}  // namespace moe::transport
