#include "moe/node/serve_handles.h"

#include "moe/base/check.h"

namespace moe::node {

uint64_t ServeHandles::keep(Kept kept) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  expire(now);
  while (!kept_.empty() && bytes_ + kept.x.size() > max_bytes_) {  // the oldest make room
    bytes_ -= kept_.begin()->second.kept.x.size();
    kept_.erase(kept_.begin());
  }
  bytes_ += kept.x.size();
  const uint64_t handle = next_++;
  kept_.emplace(handle, Entry{std::move(kept), now});
  return handle;
}

bool ServeHandles::connected(const std::string& session, uint64_t connection) {
  std::lock_guard<std::mutex> lock(mu_);
  return sessions_[session].insert(connection).second;
}

size_t ServeHandles::disconnected(const std::string& session, uint64_t connection) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto s = sessions_.find(session);
  if (s == sessions_.end() || (s->second.erase(connection), !s->second.empty())) return 0;
  sessions_.erase(s);
  size_t dropped = 0;
  for (auto it = kept_.begin(); it != kept_.end();) {
    if (it->second.kept.session != session) {
      ++it;
      continue;
    }
    bytes_ -= it->second.kept.x.size();
    it = kept_.erase(it);
    ++dropped;
  }
  return dropped;
}

bool ServeHandles::has_connections(const std::string& session) const {
  std::lock_guard<std::mutex> lock(mu_);
  return sessions_.count(session) > 0;
}

ServeHandles::Kept ServeHandles::take(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  expire(std::chrono::steady_clock::now());
  const auto it = kept_.find(handle);
  if (it == kept_.end()) {
    if (handle == 0 || handle >= next_)
      throw InvalidArgument("handle: " + std::to_string(handle) + " was never given by this node (" + rules() + ")");
    throw InvalidArgument("handle: " + std::to_string(handle) + " is spent or expired (" + rules() + ")");
  }
  Kept kept = std::move(it->second.kept);
  bytes_ -= kept.x.size();
  kept_.erase(it);
  return kept;
}

void ServeHandles::put_back(uint64_t handle, Kept kept) {
  std::lock_guard<std::mutex> lock(mu_);
  bytes_ += kept.x.size();
  kept_.emplace(handle, Entry{std::move(kept), std::chrono::steady_clock::now()});
}

void ServeHandles::expire(std::chrono::steady_clock::time_point now) {
  while (!kept_.empty() && kept_.begin()->second.at + ttl_ < now) {
    bytes_ -= kept_.begin()->second.kept.x.size();
    kept_.erase(kept_.begin());
  }
}

size_t ServeHandles::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

size_t ServeHandles::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_.size();
}

std::string ServeHandles::rules() const {
  return "a handle serves one backward, on the node that answered its forward, within " +
         std::to_string(ttl_.count()) + " s, while the node keeps at most " + std::to_string(max_bytes_ >> 20) +
         " MiB of rows and the client's session keeps a connection to it";
}

}  // namespace moe::node
