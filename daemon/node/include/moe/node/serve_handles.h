// The rows forward calls of a training serving job kept for their backward
// (docs/serving.md#training), on the node that answered them: one handle per
// call, spent by its one backward. Bounded: at most `max_bytes` of rows (the
// oldest handles make room) and `ttl` old (older ones go first), and a
// client's session's handles go when the last of its connections to the node
// closes (docs/serving.md#disconnects). Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace moe::node {

class ServeHandles {
 public:
  ServeHandles(size_t max_bytes, std::chrono::seconds ttl) : max_bytes_(max_bytes), ttl_(ttl) {}

  struct Kept {
    int layer = 0;
    std::vector<uint8_t> x;
    std::string session;  // the client's (Hello.session; "": none)
  };
  // Keeps the rows; returns their handle (nonzero, never reused).
  uint64_t keep(Kept kept);
  // Takes the handle's rows (spent). Throws moe::InvalidArgument naming a handle
  // that is unknown, spent, expired or pushed out.
  Kept take(uint64_t handle);
  // A backward call refused after take(): its handle is good again.
  void put_back(uint64_t handle, Kept kept);
  size_t bytes() const;
  size_t count() const;
  // A session's call came on `connection`: true the first time (the caller then
  // says when it closes). A session with no connection left loses its handles.
  bool connected(const std::string& session, uint64_t connection);
  // Returns the handles dropped (the session's last connection closed).
  size_t disconnected(const std::string& session, uint64_t connection);
  bool has_connections(const std::string& session) const;
  // Why a handle may be gone, for errors: its rules.
  std::string rules() const;

 private:
  void expire(std::chrono::steady_clock::time_point now);  // under mu_

  struct Entry {
    Kept kept;
    std::chrono::steady_clock::time_point at;
  };
  const size_t max_bytes_;
  const std::chrono::seconds ttl_;
  mutable std::mutex mu_;
  std::map<uint64_t, Entry> kept_;  // by handle: by age
  std::map<std::string, std::set<uint64_t>> sessions_;  // their open connections
  uint64_t next_ = 1;
  size_t bytes_ = 0;
};

}  // namespace moe::node
