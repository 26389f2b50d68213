#include "moe/spec/expert_map_codec.h"

#include "moe/base/check.h"

namespace moe::spec {

v1::PlacementMap to_proto(const ExpertMap& m, int layer) {
  v1::PlacementMap p;
  p.set_epoch(m.epoch);
  p.set_layer(layer);
  p.set_num_experts(m.num_experts);
  p.set_num_ranks(m.num_ranks);
  p.set_slots_per_rank(m.slots_per_rank);
  *p.mutable_phy2log() = {m.phy2log.begin(), m.phy2log.end()};
  *p.mutable_logcnt() = {m.logcnt.begin(), m.logcnt.end()};
  return p;
}

ExpertMap from_proto(const v1::PlacementMap& m) {
  try {
    return ExpertMap::make(m.num_experts(), m.num_ranks(), m.slots_per_rank(),
                           {m.phy2log().begin(), m.phy2log().end()}, m.epoch());
  } catch (const Error& e) {
    detail::fail("placement map of layer ", m.layer(), ": ", e.what());
  }
}

}  // namespace moe::spec
