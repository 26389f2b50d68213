#include "moe/jobs/world_change.h"

#include <algorithm>

#include "moe/base/check.h"
#include "moe/spec/expert_map_codec.h"

namespace moe::agent {
namespace {

std::string join(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s;
}

// The experts of rank `rank`'s slots in a map.
std::set<int> experts_on(const ExpertMap& m, int rank) {
  std::set<int> out;
  const std::vector<bool> hosted = m.hosted(rank);
  for (size_t e = 0; e < hosted.size(); ++e)
    if (hosted[e]) out.insert(static_cast<int>(e));
  return out;
}

}  // namespace

WorldChangePlan plan_world(const WorldChangeInput& in) {
  const int D = in.devices_per_node;
  const bool train = in.spec.mode() == v1::JobSpec::train;
  WorldChangePlan plan;
  for (int n : in.nodes)
    if (!in.lost.count(n)) plan.nodes.push_back(n);
  MOE_CHECK(!plan.nodes.empty(), "every node of the job was lost");
  for (int n : in.joining)
    if (std::find(plan.nodes.begin(), plan.nodes.end(), n) == plan.nodes.end()) plan.nodes.push_back(n);
  std::sort(plan.nodes.begin(), plan.nodes.end());  // by node index: a world grown back is the first one
  const int old_world = static_cast<int>(in.nodes.size()) * D;
  const int new_world = static_cast<int>(plan.nodes.size()) * D;
  plan.world.set_world_size(new_world);
  // A node's ranks stay consecutive.
  for (size_t pos = 0; pos < in.nodes.size(); ++pos) {
    const auto at = std::find(plan.nodes.begin(), plan.nodes.end(), in.nodes[pos]);
    for (int d = 0; d < D; ++d)
      plan.world.add_new_rank(in.lost.count(in.nodes[pos]) ? -1 : static_cast<int>(at - plan.nodes.begin()) * D + d);
  }
  // The resume step: train, the furthest any survivor applied (a survivor one
  // behind holds that step's reduced gradients and applies them); forward, the
  // least (a survivor one ahead takes its bias update back).
  int lo = -1, hi = -1;
  for (int r = 0; r < old_world; ++r) {
    if (plan.world.new_rank(r) < 0) continue;
    const auto it = in.halted.find(r);
    MOE_CHECK(it != in.halted.end(), "rank ", r, " did not report what it applied");
    const int a = it->second.applied_steps();
    lo = lo < 0 ? a : std::min(lo, a);
    hi = std::max(hi, a);
  }
  MOE_CHECK(hi - lo <= 1, "the surviving ranks applied between ", lo, " and ", hi, " steps");
  const int resume = train ? hi : lo;
  for (const auto& [r, h] : in.halted)
    if (train && plan.world.new_rank(r) >= 0 && h.applied_steps() < resume)
      MOE_CHECK(h.pending(), "rank ", r, " applied ", h.applied_steps(), " step(s) without the gradients of step ",
                h.applied_steps(), ", which another survivor applied");
  plan.world.set_resume_step(resume);
  plan.steps_recomputed = train ? 0 : hi - lo;
  const bool keep_global = in.spec.elastic_batch() != v1::JobSpec::per_rank;
  const int64_t global = static_cast<int64_t>(in.tokens_per_rank) * old_world;
  MOE_CHECK(!keep_global || global % new_world == 0, "elastic_batch global: the global batch of ", global,
            " tokens does not divide over ", new_world, " ranks");
  plan.world.set_tokens_per_rank(keep_global ? static_cast<int>(global / new_world) : in.tokens_per_rank);
  return plan;
}

std::vector<v1::ExpertMove> expert_moves(const WorldChangeInput& in, const WorldChangePlan& plan,
                                         const std::vector<v1::PlacementMap>& maps) {
  std::vector<v1::ExpertMove> moves;
  if (in.spec.mode() != v1::JobSpec::train) return moves;
  const int old_world = plan.world.new_rank_size();
  std::vector<int> old_of(plan.world.world_size(), -1);  // new rank -> old rank
  for (int r = 0; r < old_world; ++r)
    if (plan.world.new_rank(r) >= 0) old_of[plan.world.new_rank(r)] = r;
  std::vector<int> sends(plan.world.world_size(), 0);
  std::string lost;
  for (size_t l = 0; l < maps.size(); ++l) {
    // Per expert, the new ranks that hold it now (their old slots; a joining rank none).
    std::map<int, std::vector<int>> holders;
    for (int nr = 0; nr < plan.world.world_size(); ++nr) {
      if (old_of[nr] < 0) continue;
      const v1::RankHalted& h = in.halted.at(old_of[nr]);
      MOE_CHECK(static_cast<int>(l) < h.hosted_size(), "rank ", old_of[nr], " reported ", h.hosted_size(),
                " layers of experts, the job has ", maps.size());
      for (int e : h.hosted(l).experts()) holders[e].push_back(nr);
    }
    std::vector<int> missing;
    const ExpertMap next = spec::from_proto(maps[l]);
    for (int nr = 0; nr < plan.world.world_size(); ++nr) {
      for (int e : experts_on(next, nr)) {
        auto& from = holders[e];
        if (std::find(from.begin(), from.end(), nr) != from.end()) continue;  // it keeps its own
        if (from.empty()) {
          if (std::find(missing.begin(), missing.end(), e) == missing.end()) missing.push_back(e);
          continue;
        }
        const int src = *std::min_element(from.begin(), from.end(), [&](int a, int b) { return sends[a] < sends[b]; });
        ++sends[src];
        v1::ExpertMove& mv = moves.emplace_back();
        mv.set_layer(static_cast<int>(l));
        mv.set_expert(e);
        mv.set_from_rank(src);
        mv.set_to_rank(nr);
      }
    }
    if (missing.empty()) continue;
    std::sort(missing.begin(), missing.end());
    std::set<std::string> where;
    const ExpertMap old = l < in.old_maps.size() ? spec::from_proto(in.old_maps[l]) : ExpertMap{};
    for (int e : missing)
      for (int r = 0; r < old_world && l < in.old_maps.size(); ++r)
        if (experts_on(old, r).count(e)) {
          const int node = in.nodes[r / in.devices_per_node];
          where.insert(node < static_cast<int>(in.node_names.size()) ? in.node_names[node] : std::to_string(node));
        }
    std::string nodes;
    for (const auto& n : where) nodes += (nodes.empty() ? "" : ", ") + n;
    lost += (lost.empty() ? "" : "; ") + std::string("layer ") + std::to_string(l) + ": expert(s) " + join(missing) +
            " (only on node " + nodes + ")";
  }
  MOE_CHECK(lost.empty(), "experts lost with no surviving copy: ", lost);
  return moves;
}

int lost_experts(const WorldChangeInput& in, const WorldChangePlan& plan) {
  if (in.spec.mode() != v1::JobSpec::train) return 0;
  int lost = 0;
  for (size_t l = 0; l < in.old_maps.size(); ++l) {
    std::set<int> held;
    for (const auto& [r, h] : in.halted)
      if (r < plan.world.new_rank_size() && plan.world.new_rank(r) >= 0 && static_cast<int>(l) < h.hosted_size())
        held.insert(h.hosted(l).experts().begin(), h.hosted(l).experts().end());
    lost += in.old_maps[l].num_experts() - static_cast<int>(held.size());
  }
  return lost;
}

}  // namespace moe::agent
