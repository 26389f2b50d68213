// moed's Prometheus metrics (docs/metrics.md#daemon-metrics), served on --metrics-port:
//   moe_expert_tokens_total{layer,expert,rank}  pairs routed to each logical expert, by source rank
//   moe_rank_tokens_total{layer,rank}           pairs each rank's experts computed (its load)
//   moe_dispatch_seconds / moe_combine_seconds {direction,layer,rank,device}
//   moe_expert_compute_seconds{direction}
//   moe_transport_bytes_total{op,direction,layer,rank,device}, moe_transport_received_bytes_total{...the same}
//   moe_naive_transport_bytes_total{op}, moe_step_seconds, moe_build_info{version,backend,gemm_engine},
//   moe_rebalance_copy_bytes_total (expert state received by live rebalances)
//   moe_serve_calls_total{layer,kind,outcome}, moe_serve_rows_total{layer,kind},
//   moe_serve_call_seconds{layer,kind}, moe_serve_queued_rows: a serving job's calls
//   (kind = forward | backward, outcome = ok | failed; docs/serving.md#statistics)
// direction = forward | backward, op = dispatch | combine; rank is the rank in
// the job's world when it recorded (an elastic job renumbers), device the rank's
// device on this node (stable; with the scrape's node label it names the
// hardware). Rank threads record into it concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace moe::metrics {

// What one rank did in one layer of one step, in one direction. In backward,
// "dispatch" is the grad_out rows going out (combine^T) and "combine" the grad
// rows coming back (dispatch^T).
struct LayerStep {
  int layer = 0;
  std::vector<int64_t> expert_tokens;  // forward: this rank's kept pairs by logical expert
  int64_t computed_pairs = 0;          // forward: pairs this rank's experts computed
  double dispatch_seconds = 0, combine_seconds = 0, expert_seconds = 0;
  int64_t dispatch_bytes = 0, dispatch_received_bytes = 0;
  int64_t combine_bytes = 0, combine_received_bytes = 0;
  int64_t naive_dispatch_bytes = 0, naive_combine_bytes = 0;  // forward
};

// Who recorded: the rank in its job's world and its device on this node.
struct RankOf {
  int rank = 0;
  int device = 0;
};

class DaemonMetrics {
 public:
  // listen: "PORT" (loopback only) or "HOST:PORT"; port 0 picks one.
  explicit DaemonMetrics(const std::string& listen);
  ~DaemonMetrics();
  int port() const;
  std::string address() const;  // HOST:PORT a scraper can reach
  void set_build_info(const std::string& version, const std::string& backend, const std::string& gemm_engine);
  void record_forward(const RankOf& who, const LayerStep& s);
  void record_backward(const RankOf& who, const LayerStep& s);
  void record_step(int rank, double seconds);
  void record_rebalance_copy(int64_t bytes_received);  // moe_rebalance_copy_bytes_total
  // A serving job's call as it ended (rows and seconds count when answered).
  void record_serve_call(int layer, bool backward, bool ok, int64_t rows, double seconds);
  void set_serve_queued_rows(int64_t rows);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::metrics
