#include "moe/node/serve_loop.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include "moe/base/clock.h"
#include "moe/base/log.h"
#include "moe/node/checkpoint.h"
#include "moe/node/routing_trace.h"
#include "moe/node/serve_window.h"

namespace moe::node {
namespace {

// The lane the step runs: the largest summed wait, the lowest on a tie; -1: none waits.
int chosen_lane(const float* waited, int lanes) {
  int best = -1;
  for (int l = 0; l < lanes; ++l)
    if (waited[l] > 0 && (best < 0 || waited[l] > waited[best])) best = l;
  return best;
}

// Rows [first, first + n) of each piece's `rows` (x or grad_y), back to back.
std::vector<uint8_t> gather(const std::vector<ServePiece>& pieces, std::vector<uint8_t> ServeCall::*rows,
                            size_t row_bytes) {
  int64_t n = 0;
  for (const ServePiece& p : pieces) n += p.n;
  std::vector<uint8_t> out(n * row_bytes);
  size_t at = 0;
  for (const ServePiece& p : pieces) {
    std::copy_n(((*p.call).*rows).data() + p.first * row_bytes, p.n * row_bytes, out.data() + at);
    at += p.n * row_bytes;
  }
  return out;
}

// A forward step's routing (and rows) into the trace.
void record(const ServeRank& r, RoutingTrace& trace, int layer, const std::vector<uint8_t>& x, int64_t rows) {
  std::vector<int32_t> ids;
  std::vector<float> weights;
  r.stack.serve_routing(layer, rows, ids, weights);
  const layer_spec::JobView& job = r.stack.job();
  const std::vector<float> x32 = trace.keeps_hidden()
                                     ? model::from_storage(x.data(), static_cast<size_t>(rows) * job.shape.hidden, job.dtype)
                                     : std::vector<float>{};
  trace.add(layer, rows, ids.data(), weights.data(), x32.data());
}

// This rank's rows of `lane` for the step, run and handed back, the step's
// figures into the window; a piece whose step failed fails its call (or, the
// world having failed, waits again) before the error goes on.
void run_pieces(const ServeRank& r, int lane, ServeWindow& window, RoutingTrace* trace) {
  const int layer = lane / kServeKinds;
  const auto kind = static_cast<ServeKind>(lane % kServeKinds);
  const std::vector<ServePiece> pieces = r.node.queue.take(lane, r.stack.job().tokens_per_rank);
  const size_t row_bytes = kernels::dtype_size(r.stack.job().dtype) * r.stack.job().shape.hidden;
  try {
    const double t0 = now_seconds();
    StepReport step(0, r.stack.job().shape.num_experts);
    const std::vector<uint8_t> x = gather(pieces, &ServeCall::x, row_bytes);
    const auto rows = static_cast<int64_t>(x.size() / row_bytes);
    const std::vector<uint8_t> y =
        kind == ServeKind::kForward
            ? r.stack.serve_forward(layer, x, rows, step)
            : r.stack.serve_backward(layer, x, gather(pieces, &ServeCall::grad_y, row_bytes), rows, step);
    if (trace && kind == ServeKind::kForward && trace->wants(layer)) record(r, *trace, layer, x, rows);
    size_t at = 0;
    for (const ServePiece& p : pieces) {
      r.node.queue.finish(p, y.data() + at);
      at += p.n * row_bytes;
    }
    step.set_step_seconds(now_seconds() - t0);
    step.record(r.metrics, r.rank, r.device);  // the per-expert load and transfer series, as a job's steps
    window.add(layer, rows, step);
  } catch (const transport::TransportError&) {
    // The world failed: an elastic job's next world computes the rows
    // (docs/serving.md#elastic-serving); any other job's end fails their calls.
    r.node.queue.put_back(pieces);
    throw;
  } catch (const std::exception& e) {
    for (const ServePiece& p : pieces) r.node.queue.fail(p, e.what());
    throw;
  }
}

// Collective: the job's state after `steps` optimizer steps, in its checkpoint_dir.
void checkpoint(const ServeRank& r, int64_t steps) {
  if (r.stack.job().checkpoint_dir.empty()) return;
  write_checkpoint(r.start, r.stack, static_cast<int>(steps), r.rank, r.comm, transport::deadline_in(r.timeout));
  if (r.first_on_node) log::info("job ", r.start.job_id(), ": checkpoint after ", steps, " optimizer step(s)");
}

// Every layer's weights as the job computes with them, for a weight read.
v1::ServeWeightsReply weights_reply(const ServeRank& r, int64_t steps) {
  const std::vector<model::LayerWeights> all =
      r.stack.weights_in_use(steps > 0 ? 1 : 0, transport::deadline_in(r.timeout));  // collective
  v1::ServeWeightsReply reply;
  reply.set_step(steps);
  auto bytes = [](const std::vector<float>& v) {
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  };
  for (const model::LayerWeights& w : all) {
    v1::ServeLayerWeights* l = reply.add_layers();
    l->set_gate(bytes(w.gate));
    l->set_w13(bytes(w.w13));
    l->set_w2(bytes(w.w2));
    l->set_shared_w13(bytes(w.shared_w13));
    l->set_shared_w2(bytes(w.shared_w2));
    l->set_shared_gate(bytes(w.shared_gate));
    l->set_selection_bias(bytes(w.selection_bias));
    l->set_logit_bias(bytes(w.logit_bias));
  }
  return reply;
}

// Whether the periodic checkpoints cover `steps` optimizer steps.
bool periodic(const ServeRank& r, int64_t steps) {
  const int every = r.stack.job().checkpoint_every;
  return every > 0 && steps % every == 0;
}

// The requests the vote made due, every rank taking part; the node's first rank
// answers. `steps`: the job's optimizer steps, counted by every rank.
void run_requests(const ServeRank& r, const float* sum, int64_t& steps) {
  ServeRequests& requests = r.node.requests;
  if (ServeRequests::step_due(sum)) {
    const bool applied = r.stack.serve_optimizer_step();  // the same on every rank: every rank ran every pass
    if (applied) ++steps;
    if (r.first_on_node)
      requests.step_done(applied ? "" : "step " + std::to_string(steps + 1) +
                                            ": nothing to apply, no backward call since step " +
                                            std::to_string(steps));
    if (applied && periodic(r, steps)) checkpoint(r, steps);
  }
  if (ServeRequests::weights_due(sum)) {
    const v1::ServeWeightsReply reply = weights_reply(r, steps);
    if (r.first_on_node) requests.weights_read("", reply);
  }
}

// The window every rank agreed to close, to the agent; the node's calls in the first rank's.
void close_window(const ServeRank& r, ServeWindow& window) {
  v1::StepStats stats = window.close(r.stack, r.world_epoch);
  if (r.first_on_node) {
    v1::ServeWindow* w = stats.mutable_serve();
    r.node.stats.take(*w);
    w->set_queued_rows(r.node.queue.queued());
    if (r.metrics) r.metrics->set_serve_queued_rows(w->queued_rows());
    w->set_optimizer_steps(r.node.requests.steps());
  }
  r.report(stats);
}

}  // namespace

int64_t serve_until_cancelled(const ServeRank& r, const std::function<bool()>& cancel_requested) {
  ServeQueue& queue = r.node.queue;
  const int lanes = queue.lanes();
  const auto max_wait = std::chrono::milliseconds(r.stack.job().serve_max_wait_ms);
  ServeWindow window(r.stack.num_layers(), r.stack.job().shape.num_experts, r.first_window, r.world_epoch > 0);
  // [cancel, window due | rebalance | each lane's age | requests]
  const size_t at_rebalance = 2, at_ages = at_rebalance + RebalanceSession::kVoteFloats, at_requests = at_ages + lanes;
  std::vector<float> vote(at_requests + ServeRequests::kVoteFloats);
  int64_t optimizer_steps = r.optimizer_steps;
  const layer_spec::JobView& job = r.stack.job();
  std::optional<RoutingTrace> trace;  // docs/example-lm.md#routing-traces
  if (!job.trace.dir.empty())
    trace.emplace(r.stack.num_layers(), job.shape.num_experts, job.top_k, job.shape.hidden, job.trace.tokens,
                  job.trace.hidden);
  for (int64_t step = 0;; ++step) {
    queue.wait_for_step(r.stack.job().tokens_per_rank, max_wait);
    std::fill(vote.begin(), vote.end(), 0.0f);
    vote[0] = cancel_requested() ? 1.0f : 0.0f;
    vote[1] = window.due() ? 1.0f : 0.0f;
    r.rebalance.vote(vote.data() + at_rebalance);
    // Summed gradients are per slot of the current map: it changes only between optimizer steps.
    if (r.stack.serve_grads_pending() > 0) RebalanceSession::hold(vote.data() + at_rebalance);
    const std::vector<float> ages = queue.ages(ServeClock::now());
    std::copy(ages.begin(), ages.end(), vote.begin() + at_ages);
    if (r.first_on_node) r.node.requests.vote(vote.data() + at_requests);
    r.comm.all_reduce_sum(vote.data(), vote.size(), transport::deadline_in(r.timeout));
    if (vote[0] > 0) {  // cancelled: the steps since the last checkpoint are kept too
      if (optimizer_steps > r.optimizer_steps && !periodic(r, optimizer_steps)) checkpoint(r, optimizer_steps);
      if (trace) log::info("job ", r.start.job_id(), ": routing trace ", trace->write(job.trace.dir, r.start.job_id(), r.rank));
      return step;
    }
    r.rebalance.act(vote.data() + at_rebalance, static_cast<int>(step));
    if (const int lane = chosen_lane(vote.data() + at_ages, lanes); lane >= 0) {
      window.add_step();
      run_pieces(r, lane, window, trace ? &*trace : nullptr);
    }
    run_requests(r, vote.data() + at_requests, optimizer_steps);
    if (vote[1] > 0) close_window(r, window);
    r.rebalance.after_step();  // a staged rebalance reports ready once its copies are in
    if (r.after_step) r.after_step();
  }
}

}  // namespace moe::node
