#include "moe/map/expert_map.h"

#include <algorithm>

#include "moe/base/check.h"

namespace moe {

ExpertMap ExpertMap::make(int E, int R, int S, std::vector<int32_t> phy2log, int64_t epoch,
                          const std::vector<int32_t>* replica_order) {
  MOE_CHECK(E >= 1 && R >= 1 && S >= 1, "expert map: experts, ranks and slots_per_rank must be >= 1 (got ", E, ", ",
            R, ", ", S, ")");
  MOE_CHECK(static_cast<int64_t>(phy2log.size()) == static_cast<int64_t>(R) * S, "expert map: phy2log size (",
            phy2log.size(), ") is not ranks x slots_per_rank = ", static_cast<int64_t>(R) * S);
  MOE_CHECK(!replica_order || replica_order->size() == phy2log.size(), "expert map: replica order size (",
            replica_order ? replica_order->size() : 0, ") must equal phy2log size (", phy2log.size(), ")");
  ExpertMap m;
  m.num_experts = E;
  m.num_ranks = R;
  m.slots_per_rank = S;
  m.epoch = epoch;
  m.logcnt.assign(E, 0);
  for (size_t p = 0; p < phy2log.size(); ++p) {
    const int32_t e = phy2log[p];
    MOE_CHECK(e >= -1 && e < E, "expert map: slot ", p, " holds expert ", e, ", outside [0, ", E, ")");
    if (e >= 0) ++m.logcnt[e];
  }
  for (int e = 0; e < E; ++e) {
    MOE_CHECK(m.logcnt[e] >= 1, "expert map: expert ", e, " has no slot");
    m.max_replicas = std::max(m.max_replicas, m.logcnt[e]);
  }
  const size_t X = m.max_replicas;
  m.log2phy.assign(static_cast<size_t>(E) * X, -1);
  std::vector<int32_t> next(E, 0);
  for (size_t p = 0; p < phy2log.size(); ++p) {
    const int32_t e = phy2log[p];
    if (e < 0) continue;
    const int32_t j = replica_order ? (*replica_order)[p] : next[e]++;
    MOE_CHECK(j >= 0 && j < m.logcnt[e] && m.log2phy[e * X + j] == -1, "expert map: slot ", p,
              " has replica number ", j, " of expert ", e, " (", m.logcnt[e], " replicas): not a permutation");
    m.log2phy[e * X + j] = static_cast<int32_t>(p);
  }
  m.phy2log = std::move(phy2log);
  return m;
}

ExpertMap ExpertMap::contiguous(int E, int R) {
  MOE_CHECK(R >= 1 && E % R == 0, "expert map: ", E, " experts do not divide over ", R, " ranks");
  std::vector<int32_t> p(E);
  for (int e = 0; e < E; ++e) p[e] = e;
  return make(E, R, E / R, std::move(p));
}

bool ExpertMap::full() const {
  return std::none_of(phy2log.begin(), phy2log.end(), [](int32_t e) { return e < 0; });
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

}  // namespace moe
