// moed's Prometheus metrics (DESIGN 8), served on --metrics-port:
//   moe_expert_tokens_total{layer,expert,rank}, moe_rank_tokens_total{rank},
//   moe_dispatch_seconds{direction}, moe_combine_seconds{direction},
//   moe_expert_compute_seconds, moe_transport_bytes_total{op,direction},
//   moe_naive_transport_bytes_total{op}, moe_step_seconds.
// Rank threads record into it concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moe::metrics {

// What one rank did in one layer of one step.
struct LayerStep {
  int layer = 0;
  std::vector<int64_t> expert_tokens;  // by logical expert, this rank's kept pairs
  int64_t rows = 0;                    // rows this rank's experts processed
  double dispatch_seconds = 0, combine_seconds = 0, expert_seconds = 0;
  int64_t dispatch_bytes = 0, combine_bytes = 0, naive_dispatch_bytes = 0;
};

// The backward all-to-alls of one rank in one layer of one step.
struct LayerBackwardStep {
  double dispatch_seconds = 0, combine_seconds = 0;
  int64_t dispatch_bytes = 0, combine_bytes = 0;
};

class DaemonMetrics {
 public:
  // listen: "PORT" (all interfaces) or "HOST:PORT"; port 0 picks one.
  explicit DaemonMetrics(const std::string& listen);
  ~DaemonMetrics();
  int port() const;
  void record(int rank, const LayerStep& s);
  void record_backward(int rank, const LayerBackwardStep& s);
  void record_step(int rank, double seconds);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::metrics
