// When the agent rebalances a running job on its own (docs/placement.md#auto-rebalance):
// at most once every `every` steps of a job, and only for a plan worth its copies.
// Pure: the agent feeds it steps and plans, so each gate is tested alone.
#pragma once

#include <string>

namespace moe::agent {

class AutoRebalanceGate {
 public:
  struct Options {
    int every = 0;             // steps between looks at one job; 0: never
    double threshold = 0.9;    // look only below this window balancedness
    double min_gain = 0.05;    // predicted minus measured balancedness, at least
  };
  explicit AutoRebalanceGate(Options o) : o_(o) {}

  // Step `step` (0-based) of `job` completed: whether to look at it now. A new job
  // starts its own count; a look at step s makes the next due at s + every.
  bool due(const std::string& job, int step);
  // Whether a plan is worth starting: measured balancedness (mean over layers)
  // under the threshold, the prediction at least min_gain better, and something
  // to copy (a plan equal to the maps in force moves nothing and gains nothing).
  bool worth(double measured, double predicted, size_t copies) const;

 private:
  Options o_;
  std::string job_;
  int next_ = 0;
};

}  // namespace moe::agent
