#include "moe/node/serve_loop.h"

#include <algorithm>
#include <vector>

namespace moe::node {
namespace {

// The layer the step runs: the largest summed wait, the lowest on a tie; -1: none waits.
int chosen_layer(const float* waited, int layers) {
  int best = -1;
  for (int l = 0; l < layers; ++l)
    if (waited[l] > 0 && (best < 0 || waited[l] > waited[best])) best = l;
  return best;
}

// This rank's rows of `layer` for the step, run and handed back; a piece whose
// step failed fails its call before the error goes on.
void run_pieces(const ServeRank& r, int layer) {
  const std::vector<ServePiece> pieces = r.queue.take(layer, r.stack.job().tokens_per_rank);
  int64_t rows = 0;
  for (const ServePiece& p : pieces) rows += p.n;
  const size_t row_bytes = kernels::dtype_size(r.stack.job().dtype) * r.stack.job().shape.hidden;
  try {
    std::vector<uint8_t> x(rows * row_bytes);
    size_t at = 0;
    for (const ServePiece& p : pieces) {
      std::copy_n(p.call->x.data() + p.first * row_bytes, p.n * row_bytes, x.data() + at);
      at += p.n * row_bytes;
    }
    const std::vector<uint8_t> y = r.stack.serve_forward(layer, x, rows);
    at = 0;
    for (const ServePiece& p : pieces) {
      r.queue.finish(p, y.data() + at);
      at += p.n * row_bytes;
    }
  } catch (const std::exception& e) {
    for (const ServePiece& p : pieces) r.queue.fail(p, e.what());
    throw;
  }
}

}  // namespace

int64_t serve_until_cancelled(const ServeRank& r, const std::function<bool()>& cancel_requested) {
  const int L = r.stack.num_layers();
  const auto max_wait = std::chrono::milliseconds(r.stack.job().serve_max_wait_ms);
  std::vector<float> vote(1 + RebalanceSession::kVoteFloats + L);
  for (int64_t step = 0;; ++step) {
    r.queue.wait_for_step(r.stack.job().tokens_per_rank, max_wait);
    std::fill(vote.begin(), vote.end(), 0.0f);
    vote[0] = cancel_requested() ? 1.0f : 0.0f;
    r.rebalance.vote(vote.data() + 1);
    const std::vector<float> ages = r.queue.ages(ServeClock::now());
    std::copy(ages.begin(), ages.end(), vote.begin() + 1 + RebalanceSession::kVoteFloats);
    r.comm.all_reduce_sum(vote.data(), vote.size(), transport::deadline_in(r.timeout));
    if (vote[0] > 0) return step;
    r.rebalance.act(vote.data() + 1, static_cast<int>(step));
    const int layer = chosen_layer(vote.data() + 1 + RebalanceSession::kVoteFloats, L);
    if (layer >= 0) run_pieces(r, layer);
    r.rebalance.after_step();  // a staged rebalance reports ready once its copies are in
  }
}

}  // namespace moe::node
