#include "moe/node/agent_link.h"

namespace moe::node {

void AgentLink::registered(int64_t incarnation) {
  std::lock_guard<std::mutex> lock(mu_);
  incarnation_ = incarnation;
  ++registrations_;
  unreachable_since_.reset();
}

int64_t AgentLink::registrations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return registrations_;
}

int64_t AgentLink::incarnation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return incarnation_;
}

void AgentLink::reached() {
  std::lock_guard<std::mutex> lock(mu_);
  unreachable_since_.reset();
}

void AgentLink::unreachable(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!unreachable_since_) unreachable_since_ = now;
}

AgentLink::Clock::duration AgentLink::unreachable_for(Clock::time_point now) const {
  std::lock_guard<std::mutex> lock(mu_);
  return unreachable_since_ ? now - *unreachable_since_ : Clock::duration::zero();
}

}  // namespace moe::node
