// What a daemon knows of its agent, shared by the heartbeat thread and the
// job's report sender: the agent incarnation it registered with (another one in
// a reply means the agent restarted: re-register, then re-send the reports) and
// since when no call reached the agent (moed --agent-grace). Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>

namespace moe::node {

class AgentLink {
 public:
  using Clock = std::chrono::steady_clock;

  // A registration with the agent of this incarnation succeeded.
  void registered(int64_t incarnation);
  // The incarnation of the last registration; 0 before the first.
  int64_t incarnation() const;
  // Registrations so far (the agent may forget a silent node and take it
  // back under the same incarnation: what it knew of our jobs went with it).
  int64_t registrations() const;
  // A call reached the agent.
  void reached();
  // A call could not reach the agent (unavailable or timed out).
  void unreachable(Clock::time_point now);
  // How long calls have failed to reach the agent; zero while it answers.
  Clock::duration unreachable_for(Clock::time_point now) const;

 private:
  mutable std::mutex mu_;
  int64_t incarnation_ = 0;
  int64_t registrations_ = 0;
  std::optional<Clock::time_point> unreachable_since_;
};

}  // namespace moe::node
