#include "local_hub.h"

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

void LocalHub::post_send(int src, int dst, uint64_t tag, const void* data, size_t bytes, Completion* c) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& waiting = recvs_[{src, dst, tag}];
  if (waiting.empty()) {
    const auto* p = static_cast<const uint8_t*>(data);
    sends_[{src, dst, tag}].push_back({std::vector<uint8_t>(p, p + bytes)});
    c->bytes = bytes;
    c->state.store(1, std::memory_order_release);
    return;
  }
  const Recv r = waiting.front();
  waiting.pop_front();
  deliver(data, bytes, r.data, r.bytes, c, r.c);
  wake(dst);
  wake(src);
}

void LocalHub::post_recv(int src, int dst, uint64_t tag, void* data, size_t bytes, Completion* c) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& waiting = sends_[{src, dst, tag}];
  if (waiting.empty()) {
    recvs_[{src, dst, tag}].push_back({data, bytes, c});
    return;
  }
  Send s = std::move(waiting.front());
  waiting.pop_front();
  Completion sent;  // the send completed when it was queued
  deliver(s.data.data(), s.data.size(), data, bytes, &sent, c);
  wake(dst);
}

void LocalHub::withdraw(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [key, q] : sends_)
    if (std::get<0>(key) == rank) q.clear();
  for (auto& [key, q] : recvs_)
    if (std::get<1>(key) == rank) q.clear();
}

void LocalHub::abort(int rank, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  failed_.emplace(rank, reason);
  for (const auto& [r, fd] : wake_fd_) wake(r);
}

std::optional<std::string> LocalHub::failure_of(int rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = failed_.find(rank);
  if (it == failed_.end()) return std::nullopt;
  return it->second;
}

}  // namespace moe::transport
