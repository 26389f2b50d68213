#include "moe/rebalance/auto_rebalance.h"

namespace moe::agent {

bool AutoRebalanceGate::due(const std::string& job, int step) {
  if (o_.every <= 0) return false;
  if (job != job_) {
    job_ = job;
    next_ = o_.every;
  }
  if (step + 1 < next_) return false;
  next_ = step + 1 + o_.every;
  return true;
}

bool AutoRebalanceGate::worth(double measured, double predicted, size_t copies) const {
  return measured < o_.threshold && predicted - measured >= o_.min_gain && copies > 0;
}

}  // namespace moe::agent
