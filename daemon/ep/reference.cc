#include "moe/ep/reference.h"

namespace moe::ep {

ref::Config reference_config(const MoeLayerConfig& c) {
  ref::Config rc;
  static_cast<kernels::RoutingParams&>(rc) = c.routing();
  rc.hidden = c.hidden;
  rc.ffn_hidden = c.ffn_hidden;
  rc.capacity_factor = c.capacity_factor;
  rc.drop_policy = c.drop_policy;
  return rc;
}

ref::Weights reference_weights(const model::LayerWeights& w) {
  ref::Weights r;
  r.gate.assign(w.gate.begin(), w.gate.end());
  r.selection_bias.assign(w.selection_bias.begin(), w.selection_bias.end());
  r.logit_bias.assign(w.logit_bias.begin(), w.logit_bias.end());
  r.w13.assign(w.w13.begin(), w.w13.end());
  r.w2.assign(w.w2.begin(), w.w2.end());
  return r;
}

}  // namespace moe::ep
