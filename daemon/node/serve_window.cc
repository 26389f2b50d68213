#include "moe/node/serve_window.h"

namespace moe::node {

ServeWindow::ServeWindow(int layers, int experts, int first, bool at_once)
    : layers_(layers), experts_(experts), index_(first), at_once_(at_once) {
  open();
}

void ServeWindow::open() {
  stats_.Clear();
  stats_.set_step(index_);
  for (int l = 0; l < layers_; ++l) {
    v1::ExpertTokens* t = stats_.add_expert_tokens();
    for (int e = 0; e < experts_; ++e) t->add_tokens(0);
    stats_.add_layer_pairs(0);
    stats_.mutable_serve()->add_layer_rows(0);
  }
  opened_ = std::chrono::steady_clock::now();
}

void ServeWindow::add(int layer, int64_t rows, const StepReport& step) {
  const v1::StepStats& s = step.stats();
  v1::ExpertTokens* t = stats_.mutable_expert_tokens(layer);
  for (int e = 0; e < experts_ && e < s.expert_tokens(0).tokens_size(); ++e)
    t->set_tokens(e, t->tokens(e) + s.expert_tokens(0).tokens(e));
  stats_.set_layer_pairs(layer, stats_.layer_pairs(layer) + s.layer_pairs(0));
  v1::ServeWindow* w = stats_.mutable_serve();
  w->set_layer_rows(layer, w->layer_rows(layer) + static_cast<double>(rows));
  v1::PhaseSeconds* ph = stats_.mutable_phase_seconds();
  ph->set_router(ph->router() + s.phase_seconds().router());
  ph->set_dispatch(ph->dispatch() + s.phase_seconds().dispatch());
  ph->set_expert(ph->expert() + s.phase_seconds().expert());
  ph->set_combine(ph->combine() + s.phase_seconds().combine());
  ph->set_backward(ph->backward() + s.phase_seconds().backward());
  stats_.set_dispatch_bytes(stats_.dispatch_bytes() + s.dispatch_bytes());
  stats_.set_naive_dispatch_bytes(stats_.naive_dispatch_bytes() + s.naive_dispatch_bytes());
  stats_.set_combine_bytes(stats_.combine_bytes() + s.combine_bytes());
  stats_.set_received_rows(stats_.received_rows() + s.received_rows());
  stats_.set_overlap_chunks(std::max(stats_.overlap_chunks(), s.overlap_chunks()));
}

v1::StepStats ServeWindow::close(const ModelStack& stack, int64_t world_epoch) {
  v1::StepStats out = stats_;
  out.set_step_seconds(std::max(1e-9, std::chrono::duration<double>(std::chrono::steady_clock::now() - opened_).count()));
  out.set_world_epoch(world_epoch);
  for (int l = 0; l < layers_; ++l) out.add_layer_epoch(stack.map(l).epoch);
  ++index_;
  at_once_ = false;
  open();
  return out;
}

}  // namespace moe::node
