// The sliding window of one layer's measured load
// (docs/placement.md#load-and-balancedness): per step, the (token, expert) pairs
// routed to each logical expert (summed over ranks) and the pairs each rank's
// experts computed. Expert loads span the window whatever the
// map; rank loads depend on the map, so they restart at every epoch change.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

namespace moe::agent {

// Mean / max of loads; 0 when every load is 0 or there is none.
double balancedness_of(const std::vector<double>& loads);

class LoadWindow {
 public:
  explicit LoadWindow(int steps = 32) : steps_(steps) {}

  // One step of the layer, run under `epoch`.
  void add(std::vector<double> expert, std::vector<double> rank, int64_t epoch);
  // The map changed: rank loads of the old epoch no longer describe it.
  void restart_ranks(int64_t epoch);

  std::vector<double> expert_loads() const;  // summed over the window
  std::vector<double> rank_loads() const;    // summed over this epoch's steps in the window
  int expert_steps() const { return static_cast<int>(expert_.size()); }
  int rank_steps() const { return static_cast<int>(rank_.size()); }
  int capacity() const { return steps_; }
  // mean / max of rank_loads(); 0 without a step.
  double balancedness() const;

  const std::deque<std::vector<double>>& expert_steps_data() const { return expert_; }
  const std::deque<std::vector<double>>& rank_steps_data() const { return rank_; }
  int64_t rank_epoch() const { return rank_epoch_; }
  // Restores a persisted window (oldest step first).
  void restore(std::deque<std::vector<double>> expert, std::deque<std::vector<double>> rank, int64_t rank_epoch);

 private:
  int steps_;
  std::deque<std::vector<double>> expert_, rank_;
  int64_t rank_epoch_ = -1;
};

}  // namespace moe::agent
