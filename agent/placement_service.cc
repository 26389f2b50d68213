#include "moe/agent/placement_service.h"

#include "moe/base/check.h"
#include "moe/placement/placement_metrics.h"
#include "moe/placement/placement_solver.h"

namespace moe::agent {

const std::vector<v1::PlacementMap>& PlacementService::maps_for_job(const v1::JobSpec& spec, int world,
                                                                    int num_nodes) {
  placement::PlacementSpec ps;
  ps.num_experts = spec.experts();
  ps.num_ranks = world;
  ps.num_nodes = num_nodes;
  ps.num_redundant = 0;
  // Groups kept on few nodes only where they divide over the nodes.
  ps.num_groups = spec.num_groups() > 1 && spec.num_groups() % num_nodes == 0 ? spec.num_groups() : 0;
  ps.top_k = spec.top_k();
  ps.group_top_k = ps.num_groups > 1 ? spec.group_top_k() : 0;
  const placement::LayerMap first = placement::solve_layer(ps, std::vector<double>(spec.experts(), 1.0));
  ++epoch_;
  maps_.clear();
  for (int l = 0; l < spec.layers(); ++l) maps_.push_back(to_proto(first, l, epoch_));
  return maps_;
}

void PlacementService::record_loads(std::vector<std::vector<double>> expert_tokens) {
  loads_ = std::move(expert_tokens);
}

double PlacementService::balancedness(int layer) const {
  if (layer < 0 || layer >= static_cast<int>(maps_.size()) || layer >= static_cast<int>(loads_.size())) return 0;
  const v1::PlacementMap& m = maps_[layer];
  if (static_cast<int>(loads_[layer].size()) != m.num_experts()) return 0;
  return placement::balancedness(from_proto(m), loads_[layer]);
}

v1::PlacementMap PlacementService::to_proto(const placement::LayerMap& lm, int layer, int64_t epoch) {
  v1::PlacementMap m;
  m.set_epoch(epoch);
  m.set_layer(layer);
  m.set_num_experts(lm.num_experts);
  m.set_num_ranks(lm.num_ranks);
  m.set_slots_per_rank(lm.slots_per_rank);
  *m.mutable_phy2log() = {lm.phy2log.begin(), lm.phy2log.end()};
  *m.mutable_logcnt() = {lm.logcnt.begin(), lm.logcnt.end()};
  return m;
}

placement::LayerMap PlacementService::from_proto(const v1::PlacementMap& m) {
  MOE_CHECK(m.num_ranks() >= 1 && m.slots_per_rank() >= 1, "placement map of layer ", m.layer(), ": ",
            m.num_ranks(), " ranks x ", m.slots_per_rank(), " slots");
  MOE_CHECK(m.phy2log_size() == m.num_ranks() * m.slots_per_rank(), "placement map of layer ", m.layer(), ": ",
            m.phy2log_size(), " slots, expected ", m.num_ranks() * m.slots_per_rank());
  return placement::make_layer_map(m.num_experts(), m.num_ranks(), {m.phy2log().begin(), m.phy2log().end()});
}

}  // namespace moe::agent
