// A serving job's recorded routing (docs/example-lm.md#routing-traces): per
// layer, the top-k expert ids and weights of the first `cap` forward rows this
// rank computed (in the order it computed them), and with `hidden` those rows
// as fp32, written as one safetensors file when the job is cancelled:
//   layer{l}.topk_ids [n, K] I32, layer{l}.topk_weights [n, K] F32,
//   layer{l}.hidden [n, H] F32 (with hidden);
// metadata: job, rank, layers, experts, top_k, hidden.
// One rank's thread only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe::node {

class RoutingTrace {
 public:
  RoutingTrace(int layers, int experts, int top_k, int hidden, int64_t cap, bool keep_hidden);

  // Whether rows of `layer` are still to be recorded.
  bool wants(int layer) const { return rows_[layer] < cap_; }
  // T rows of `layer` (the first ones up to the cap are kept): ids and
  // weights [T, K], x [T, H] fp32 (read only with keep_hidden).
  void add(int layer, int64_t T, const int32_t* ids, const float* weights, const float* x);
  int64_t rows(int layer) const { return rows_[layer]; }
  bool keeps_hidden() const { return keep_hidden_; }

  // dir/routing-rank{rank}.safetensors, whole or not at all; returns the path.
  std::string write(const std::string& dir, const std::string& job_id, int rank) const;

 private:
  int experts_, top_k_, hidden_;
  int64_t cap_;
  bool keep_hidden_;
  std::vector<int64_t> rows_;
  std::vector<std::vector<int32_t>> ids_;
  std::vector<std::vector<float>> weights_, x_;
};

}  // namespace moe::node
