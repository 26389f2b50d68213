#include "moe/ep/expert_map.h"

#include "moe/base/check.h"

namespace moe::ep {

ExpertMap ExpertMap::make(int E, int R, int S, std::vector<int32_t> phy2log, int64_t epoch) {
  MOE_CHECK(E >= 1 && R >= 1 && S >= 1, "expert map: experts, ranks and slots_per_rank must be >= 1 (got ", E, ", ",
            R, ", ", S, ")");
  MOE_CHECK(static_cast<int64_t>(phy2log.size()) == static_cast<int64_t>(R) * S, "expert map: phy2log has ",
            phy2log.size(), " slots, expected ranks x slots_per_rank = ", R * S);
  ExpertMap m;
  m.num_experts = E;
  m.num_ranks = R;
  m.slots_per_rank = S;
  m.epoch = epoch;
  m.logcnt.assign(E, 0);
  for (size_t p = 0; p < phy2log.size(); ++p) {
    const int32_t e = phy2log[p];
    MOE_CHECK(e >= -1 && e < E, "expert map: slot ", p, " holds expert ", e, ", out of range [0, ", E, ")");
    if (e >= 0) ++m.logcnt[e];
  }
  for (int e = 0; e < E; ++e) {
    MOE_CHECK(m.logcnt[e] >= 1, "expert map: expert ", e, " has no slot");
    m.max_replicas = std::max(m.max_replicas, m.logcnt[e]);
  }
  m.log2phy.assign(static_cast<size_t>(E) * m.max_replicas, -1);
  std::vector<int> filled(E, 0);
  for (size_t p = 0; p < phy2log.size(); ++p)
    if (phy2log[p] >= 0) m.log2phy[phy2log[p] * m.max_replicas + filled[phy2log[p]]++] = static_cast<int32_t>(p);
  m.phy2log = std::move(phy2log);
  return m;
}

ExpertMap ExpertMap::contiguous(int E, int R) {
  MOE_CHECK(R >= 1 && E % R == 0, "expert map: ", E, " experts do not divide over ", R, " ranks");
  std::vector<int32_t> p(E);
  for (int e = 0; e < E; ++e) p[e] = e;
  return make(E, R, E / R, std::move(p));
}

std::vector<bool> ExpertMap::hosted(int rank) const {
  std::vector<bool> h(num_experts, false);
  for (int s = 0; s < slots_per_rank; ++s)
    if (expert_at(rank, s) >= 0) h[expert_at(rank, s)] = true;
  return h;
}

std::vector<int32_t> ExpertMap::replicas(int e) const {
  return {log2phy.begin() + static_cast<int64_t>(e) * max_replicas,
          log2phy.begin() + static_cast<int64_t>(e) * max_replicas + logcnt[e]};
}

}  // namespace moe::ep
