#include "moe/ep/reference.h"

namespace moe::ep {

ref::Config reference_config(const MoeLayerConfig& c) {
  ref::Config rc;
  static_cast<kernels::RoutingParams&>(rc) = c.routing();
  rc.hidden = c.hidden;
  rc.ffn_hidden = c.ffn_hidden;
  rc.capacity_factor = c.capacity_factor;
  rc.drop_policy = c.drop_policy;
  rc.aux_loss_coeff = c.aux_loss_coeff;
  rc.z_loss_coeff = c.z_loss_coeff;
  rc.shared_ffn_hidden = c.shared_ffn_hidden;
  rc.shared_gate = c.shared_gate;
  return rc;
}

ref::Weights reference_weights(const model::LayerWeights& w) {
  ref::Weights r;
  r.gate.assign(w.gate.begin(), w.gate.end());
  r.selection_bias.assign(w.selection_bias.begin(), w.selection_bias.end());
  r.logit_bias.assign(w.logit_bias.begin(), w.logit_bias.end());
  r.w13.assign(w.w13.begin(), w.w13.end());
  r.w2.assign(w.w2.begin(), w.w2.end());
  r.shared_w13.assign(w.shared_w13.begin(), w.shared_w13.end());
  r.shared_w2.assign(w.shared_w2.begin(), w.shared_w2.end());
  r.shared_gate.assign(w.shared_gate.begin(), w.shared_gate.end());
  return r;
}

}  // namespace moe::ep
