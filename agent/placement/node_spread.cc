#include "node_spread.h"

#include <algorithm>
#include <limits>

#include "moe/base/check.h"

namespace moe::placement::detail {
namespace {

// copies[e][n]: e's copies on node n.
class NodeCopies {
 public:
  NodeCopies(const PlacementSpec& spec, const std::vector<int32_t>& phy2log)
      : slots_per_node_(spec.slots_per_node()), copies_(spec.num_experts, std::vector<int>(spec.num_nodes, 0)) {
    for (size_t p = 0; p < phy2log.size(); ++p) ++copies_[phy2log[p]][node_of(static_cast<int>(p))];
  }
  int node_of(int slot) const { return slot / slots_per_node_; }
  int on(int expert, int node) const { return copies_[expert][node]; }
  int span(int expert) const {
    return static_cast<int>(std::count_if(copies_[expert].begin(), copies_[expert].end(), [](int c) { return c > 0; }));
  }
  void move(int expert, int from, int to) {
    --copies_[expert][from];
    ++copies_[expert][to];
  }

 private:
  int slots_per_node_;
  std::vector<std::vector<int>> copies_;
};

}  // namespace

void spread_over_nodes(const PlacementSpec& spec, std::span<const double> unit, std::vector<int32_t>& phy2log) {
  const int m = spec.min_node_replicas;
  if (m <= 1) return;
  const int slots = spec.num_slots(), S = spec.slots_per_rank();
  NodeCopies copies(spec, phy2log);
  std::vector<double> rank_load(spec.num_ranks, 0.0);
  for (int p = 0; p < slots; ++p) rank_load[p / S] += unit[phy2log[p]];
  for (int e = 0; e < spec.num_experts; ++e) {
    while (copies.span(e) < m) {
      // A copy of e on a node that holds two or more of them.
      int from = -1;
      for (int p = 0; p < slots && from < 0; ++p)
        if (phy2log[p] == e && copies.on(e, copies.node_of(p)) > 1) from = p;
      MOE_CHECK(from >= 0, "placement: expert ", e, " has fewer than min_node_replicas (", m, ") copies");
      const int n_from = copies.node_of(from);
      // Its partner: a copy on a node without e, of an expert whose span stays >= m.
      int best = -1;
      double best_max = std::numeric_limits<double>::infinity();
      for (int q = 0; q < slots; ++q) {
        const int f = phy2log[q], n_to = copies.node_of(q);
        if (f == e || copies.on(e, n_to) > 0) continue;
        const int f_span = copies.span(f) - (copies.on(f, n_to) == 1 ? 1 : 0) + (copies.on(f, n_from) == 0 ? 1 : 0);
        if (f_span < std::min(m, copies.span(f))) continue;
        const double delta = unit[f] - unit[e];
        const double worst = std::max(rank_load[from / S] + delta, rank_load[q / S] - delta);
        if (worst < best_max) best_max = worst, best = q;
      }
      MOE_CHECK(best >= 0, "placement: cannot spread expert ", e, "'s copies over ", m, " nodes");
      const int f = phy2log[best];
      rank_load[from / S] += unit[f] - unit[e];
      rank_load[best / S] += unit[e] - unit[f];
      copies.move(e, n_from, copies.node_of(best));
      copies.move(f, copies.node_of(best), n_from);
      std::swap(phy2log[from], phy2log[best]);
    }
  }
}

}  // namespace moe::placement::detail
