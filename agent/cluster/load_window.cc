#include "moe/cluster/load_window.h"

#include <algorithm>

namespace moe::agent {

double balancedness_of(const std::vector<double>& loads) {
  if (loads.empty()) return 0;
  const double mx = *std::max_element(loads.begin(), loads.end());
  double mean = 0;
  for (double v : loads) mean += v / static_cast<double>(loads.size());
  return mx > 0 ? mean / mx : 0.0;
}

namespace {

std::vector<double> sum(const std::deque<std::vector<double>>& steps) {
  std::vector<double> total;
  for (const auto& s : steps) {
    if (total.size() < s.size()) total.resize(s.size(), 0.0);
    for (size_t i = 0; i < s.size(); ++i) total[i] += s[i];
  }
  return total;
}

}  // namespace

void LoadWindow::add(std::vector<double> expert, std::vector<double> rank, int64_t epoch) {
  if (epoch != rank_epoch_) restart_ranks(epoch);
  expert_.push_back(std::move(expert));
  rank_.push_back(std::move(rank));
  while (static_cast<int>(expert_.size()) > steps_) expert_.pop_front();
  while (static_cast<int>(rank_.size()) > steps_) rank_.pop_front();
}

void LoadWindow::restart_ranks(int64_t epoch) {
  rank_.clear();
  rank_epoch_ = epoch;
}

std::vector<double> LoadWindow::expert_loads() const { return sum(expert_); }
std::vector<double> LoadWindow::rank_loads() const { return sum(rank_); }
double LoadWindow::balancedness() const { return balancedness_of(rank_loads()); }

void LoadWindow::restore(std::deque<std::vector<double>> expert, std::deque<std::vector<double>> rank,
                         int64_t rank_epoch) {
  expert_ = std::move(expert);
  rank_ = std::move(rank);
  rank_epoch_ = rank_epoch;
}

}  // namespace moe::agent
