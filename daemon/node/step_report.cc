#include "moe/node/step_report.h"

namespace moe::node {

StepReport::StepReport(int step, int num_experts) : num_experts_(num_experts) { stats_.set_step(step); }

void StepReport::add_forward(int layer, const ep::EpLayer& l, int64_t T, int K) {
  const ep::EpStats& es = l.stats();
  const ep::DispatchStats& tr = es.transfer;
  v1::PhaseSeconds* ph = stats_.mutable_phase_seconds();
  ph->set_router(ph->router() + es.router);
  ph->set_dispatch(ph->dispatch() + es.dispatch);
  ph->set_expert(ph->expert() + es.expert);
  ph->set_combine(ph->combine() + es.combine);
  stats_.set_dispatch_bytes(stats_.dispatch_bytes() + tr.dispatch_bytes);
  stats_.set_naive_dispatch_bytes(stats_.naive_dispatch_bytes() + tr.naive_dispatch_bytes);
  stats_.set_combine_bytes(stats_.combine_bytes() + tr.combine_bytes);
  stats_.set_received_rows(stats_.received_rows() + tr.received_rows);
  note_chunks(tr.chunks);
  stats_.add_layer_pairs(static_cast<double>(es.computed_pairs));
  stats_.add_layer_epoch(l.map().epoch);

  metrics::LayerStep m{.layer = layer,
                       .expert_tokens = std::vector<int64_t>(num_experts_, 0),
                       .computed_pairs = es.computed_pairs,
                       .dispatch_seconds = tr.dispatch_transport,
                       .combine_seconds = tr.combine_transport,
                       .expert_seconds = es.expert,
                       .dispatch_bytes = tr.dispatch_bytes,
                       .dispatch_received_bytes = tr.dispatch_received_bytes,
                       .combine_bytes = tr.combine_bytes,
                       .combine_received_bytes = tr.combine_received_bytes,
                       .naive_dispatch_bytes = tr.naive_dispatch_bytes,
                       .naive_combine_bytes = tr.naive_combine_bytes};
  for (int32_t e : kernels::to_host<int32_t>(l.backend(), l.kept_idx(), T * K))
    if (e >= 0) ++m.expert_tokens[e];
  v1::ExpertTokens* et = stats_.add_expert_tokens();
  for (int64_t n : m.expert_tokens) et->add_tokens(static_cast<double>(n));
  forward_.push_back(std::move(m));
}

void StepReport::add_backward(int layer, const ep::EpLayer& l) {
  const ep::EpStats& es = l.stats();
  const ep::DispatchStats& tr = es.transfer;
  backward_.push_back({.layer = layer,
                       .dispatch_seconds = tr.backward_dispatch_transport,
                       .combine_seconds = tr.backward_combine_transport,
                       .expert_seconds = es.expert_backward,
                       .dispatch_bytes = tr.backward_dispatch_bytes,
                       .dispatch_received_bytes = tr.backward_dispatch_received_bytes,
                       .combine_bytes = tr.backward_combine_bytes,
                       .combine_received_bytes = tr.backward_combine_received_bytes});
}

void StepReport::record(metrics::DaemonMetrics* m, int rank, int device) const {
  if (!m) return;
  for (const auto& s : forward_) m->record_forward({rank, device}, s);
  for (const auto& s : backward_) m->record_backward({rank, device}, s);
  m->record_step(rank, stats_.step_seconds());
}

}  // namespace moe::node
