#include "moe/node/verify.h"

#include <algorithm>
#include <cmath>

#include "moe/ep/reference.h"
#include "moe/layer_spec/job_layers.h"

namespace moe::node {
namespace {

using kernels::DType;

// Folds |got - want| over a tensor into v: max_abs, and max_rel relative to the
// tensor's scale (max |want|).
template <typename Got>
void compare(v1::Verify& v, const Got& got, const std::vector<double>& want) {
  double max_abs = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    max_abs = std::isnan(d) ? INFINITY : std::max(max_abs, d);
    scale = std::max(scale, std::fabs(want[i]));
  }
  v.set_max_abs_error(std::max(v.max_abs_error(), max_abs));
  v.set_max_rel_error(std::max(v.max_rel_error(), scale > 0 ? max_abs / scale : max_abs));
}

void fold(v1::Verify& into, const v1::Verify& v) {
  into.set_max_abs_error(std::max(into.max_abs_error(), v.max_abs_error()));
  into.set_max_rel_error(std::max(into.max_rel_error(), v.max_rel_error()));
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// What one layer's check needs.
struct LayerCase {
  const layer_spec::JobView& job;
  const ModelStack& stack;
  int layer, rank;
  ref::Config rc;
  ref::Weights rw;
  std::vector<double> x;
  std::vector<double> expert_x;  // after the dispatch wire; empty: x
};

// The reference's own selection must agree except at near-ties fp32 cannot
// break; the numbers are then compared on our selection. Returns the forward.
ref::Forward check_forward(const LayerCase& c, v1::Verify& lv, bool& ok) {
  const LayerSnapshot& s = c.stack.snapshot(c.layer);
  const int64_t T = c.job.tokens_per_rank;
  const int K = c.job.top_k;
  const ref::Forward own = ref::forward(c.rc, c.rw, c.x, T);
  for (int64_t t = 0; t < T; ++t) {
    if (own.selection_margin[t] <= 1e-5) continue;
    for (int k = 0; k < K; ++k) ok &= own.topk_idx[t * K + k] == s.topk_idx[t * K + k];
  }
  const ep::EpLayer& layer = c.stack.layer(c.layer);
  ref::ForwardOptions opts = ref::forced(s.topk_idx.data());
  opts.global_counts.assign(layer.global_counts().begin(), layer.global_counts().end());
  opts.global_tokens = static_cast<int64_t>(layer.global_tokens());
  if (!c.expert_x.empty()) opts.expert_x = &c.expert_x;
  ref::Forward f = ref::forward(c.rc, c.rw, c.x, T, opts);
  ok &= f.kept_idx == s.kept_idx;
  compare(lv, model::from_storage(s.out.data(), T * c.job.shape.hidden, c.job.dtype), f.out);
  if (c.rc.aux_loss_coeff > 0 || c.rc.z_loss_coeff > 0) {  // this rank's shares of the losses
    const ep::BalanceLosses& got = layer.balance_losses();
    compare(lv, std::vector<double>{got.aux, got.z}, {f.aux_loss, f.z_loss});
  }
  return f;
}

// grad_x on our tokens into lv; the weight gradients, all-reduced, into gv.
void check_backward(const LayerCase& c, const ref::Forward& f, transport::Communicator& comm,
                    transport::Deadline deadline, v1::Verify& lv, v1::Verify& gv) {
  const LayerSnapshot& s = c.stack.snapshot(c.layer);
  const size_t n = c.job.tokens_per_rank * c.job.shape.hidden;
  const DType dt = c.job.dtype;
  const ref::Grads g = ref::backward(c.rc, c.rw, c.x, f, to_double(model::from_storage(s.grad_out.data(), n, dt)));
  compare(lv, model::from_storage(s.grad_x.data(), n, dt), g.grad_x);
  std::vector<float> gate(g.grad_gate.begin(), g.grad_gate.end());
  std::vector<float> w13(g.grad_w13.begin(), g.grad_w13.end()), w2(g.grad_w2.begin(), g.grad_w2.end());
  comm.all_reduce_sum(gate.data(), gate.size(), deadline);
  comm.all_reduce_sum(w13.data(), w13.size(), deadline);
  comm.all_reduce_sum(w2.data(), w2.size(), deadline);
  const ep::EpGrads& got = s.grads;
  compare(gv, got.gate, to_double(gate));
  if (c.stack.layer(c.layer).shared_experts()) {
    for (const auto& [have, want] : {std::pair{&got.shared_w13, &g.grad_shared_w13},
                                     std::pair{&got.shared_w2, &g.grad_shared_w2},
                                     std::pair{&got.shared_gate, &g.grad_shared_gate}}) {
      std::vector<float> sum(want->begin(), want->end());
      comm.all_reduce_sum(sum.data(), sum.size(), deadline);
      if (!sum.empty()) compare(gv, *have, to_double(sum));
    }
  }
  const size_t H = c.job.shape.hidden, I = c.job.shape.ffn_hidden, n13 = 2 * I * H, n2 = H * I;
  const moe::ExpertMap& map = c.stack.map(c.layer);
  for (int slot = 0; slot < map.slots_per_rank; ++slot) {
    const int e = map.expert_at(c.rank, slot);
    if (e < 0) continue;
    compare(gv, got.w13.data() + slot * n13, std::vector<double>(w13.begin() + e * n13, w13.begin() + (e + 1) * n13));
    compare(gv, got.w2.data() + slot * n2, std::vector<double>(w2.begin() + e * n2, w2.begin() + (e + 1) * n2));
  }
}

}  // namespace

v1::Verify verify_step(const layer_spec::JobView& job, const ModelStack& stack,
                       const std::vector<model::LayerWeights>& weights, int rank, transport::Communicator& comm,
                       transport::Deadline deadline) {
  const DType dt = job.dtype;
  // Weight gradients are fp32 sums; in a bf16 job on the oneDNN engine one operand
  // of each (h or dgu) is rounded to bf16 first (2^-8 of each term): 1/64 of the
  // tensor's scale, as the bf16 outputs.
  // A bf16 combine wire rounds each rank's partial rows: out is held as a bf16 job's.
  const kernels::WireFormatInfo& dispatch = kernels::resolve_wire(job.dispatch_wire, dt, kernels::WireRole::kDispatch);
  const kernels::WireFormatInfo& combine = kernels::resolve_wire(job.combine_wire, dt, kernels::WireRole::kCombine);
  const bool bf16_out = dt == DType::kBF16 || combine.dtype == DType::kBF16;
  const double tol = bf16_out ? 1.0 / 64 : 1e-4, grad_tol = dt == DType::kF32 ? 1e-3 : 1.0 / 64;
  const ref::Config rc = ep::reference_config(layer_spec::layer_config(job.spec));
  v1::Verify out;
  bool ok = true;
  for (int l = 0; l < stack.num_layers(); ++l) {
    const LayerSnapshot& s = stack.snapshot(l);
    const std::vector<float> x = model::from_storage(s.x.data(), job.tokens_per_rank * job.shape.hidden, dt);
    LayerCase c{job, stack, l, rank, rc, ep::reference_weights(weights[l]), to_double(x),
                ref::expert_rows_through(dispatch.format, dt, x, job.shape.hidden)};
    v1::Verify lv, gv;  // out and grad_x (held to tol); weight gradients (grad_tol)
    const ref::Forward f = check_forward(c, lv, ok);
    if (job.train) check_backward(c, f, comm, deadline, lv, gv);
    ok &= lv.max_rel_error() <= tol && gv.max_rel_error() <= grad_tol;
    fold(out, lv);
    fold(out, gv);
  }
  out.set_passed(ok && std::isfinite(out.max_abs_error()));
  return out;
}

}  // namespace moe::node
