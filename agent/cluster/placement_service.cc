#include "moe/cluster/placement_service.h"

#include <algorithm>
#include <string_view>

#include "moe/base/check.h"
#include "moe/placement/copy_plan.h"
#include "moe/placement/placement_metrics.h"
#include "moe/placement/placement_solver.h"
#include "moe/rpc/frame.h"
#include "moe/spec/expert_map_codec.h"

namespace moe::agent {

using rpc::RpcError;

ShapeKey ShapeKey::of(const v1::PlacementShape& s) { return {s.experts(), s.layers(), s.nodes(), s.devices_per_node()}; }

v1::PlacementShape ShapeKey::proto() const {
  v1::PlacementShape s;
  s.set_experts(experts);
  s.set_layers(layers);
  s.set_nodes(nodes);
  s.set_devices_per_node(devices_per_node);
  return s;
}

std::string ShapeKey::flag() const {
  return std::to_string(experts) + "x" + std::to_string(layers) + "@" + std::to_string(nodes) + "x" +
         std::to_string(devices_per_node);
}

std::string ShapeKey::name() const {
  return std::to_string(experts) + " experts x " + std::to_string(layers) + " layers on " + std::to_string(nodes) +
         "x" + std::to_string(devices_per_node);
}

namespace {

// The origin's end of a shape's first maps: what a shape never placed gets.
constexpr const char* kUniformStart = " (the solver's for uniform load)";

// A map the agent keeps as cluster state: every slot holds an expert.
ExpertMap checked_map(const v1::PlacementMap& m) {
  ExpertMap map = spec::from_proto(m);
  MOE_CHECK(map.full(), "placement map of layer ", m.layer(), ": every slot must hold an expert");
  return map;
}

}  // namespace

const PlacementService::Shape& PlacementService::find(const ShapeKey& shape) const {
  const auto it = shapes_.find(shape);
  if (it == shapes_.end())
    throw RpcError(v1::ERROR_CODE_NOT_FOUND, "no placement for the shape " + shape.name() + " (no job has run on it)");
  return it->second;
}

namespace {

// The node redundancy a shape gets on `key`: its min_node_replicas (0: unset),
// at least 1 and at most the nodes it has. The one place it is clamped.
int min_nodes_on(const ShapeKey& key, int min_node_replicas) {
  return std::clamp(min_node_replicas, 1, std::max(1, key.nodes));
}

// The fewest redundant slots that put every expert on `m` nodes and fill whole ranks.
int redundant_for(const ShapeKey& key, int m) {
  int redundant = key.experts * (m - 1);
  while ((key.experts + redundant) % key.ranks() != 0) ++redundant;
  return redundant;
}

}  // namespace

placement::PlacementSpec PlacementService::solver_spec(const ShapeKey& key, const Shape& s, int redundant) const {
  placement::PlacementSpec ps;
  ps.num_experts = key.experts;
  ps.num_ranks = key.ranks();
  ps.num_nodes = key.nodes;
  ps.num_redundant = redundant;
  // Groups kept on few nodes only where they divide over the nodes.
  ps.num_groups = s.num_groups > 1 && s.num_groups % key.nodes == 0 ? s.num_groups : 0;
  ps.top_k = s.top_k;
  ps.group_top_k = ps.num_groups > 1 ? s.group_top_k : 0;
  ps.min_node_replicas = min_nodes_on(key, s.min_node_replicas);
  return ps;
}

// Whether every layer's map keeps each expert on min_node_replicas nodes.
bool PlacementService::spread_enough(const ShapeKey& key, const Shape& s) const {
  const int m = min_nodes_on(key, s.min_node_replicas);
  if (m <= 1) return true;
  for (const ExpertMap& map : s.maps)
    if (placement::min_nodes_spanned(map, key.nodes) < m) return false;
  return true;
}

std::vector<v1::PlacementMap> PlacementService::Shape::protos() const {
  std::vector<v1::PlacementMap> out;
  for (size_t l = 0; l < maps.size(); ++l) out.push_back(spec::to_proto(maps[l], static_cast<int>(l)));
  return out;
}

std::vector<v1::PlacementMap> PlacementService::place(const ShapeKey& key, Shape& s, std::vector<ExpertMap> maps,
                                                      const std::string& origin) {
  ++epoch_;
  s.origin = origin;
  for (ExpertMap& m : maps) m.epoch = epoch_;
  s.maps = std::move(maps);
  s.windows.assign(key.layers, LoadWindow(window_steps_));
  return s.protos();
}

PlacementService::Shape& PlacementService::shape_for_job(const v1::JobSpec& spec, const ShapeKey& key) {
  last_shape_ = key;
  Shape& s = shapes_[key];
  s.num_groups = spec.num_groups();
  s.top_k = spec.top_k();
  s.group_top_k = spec.group_top_k();
  s.min_node_replicas = spec.min_node_replicas();
  return s;
}

std::vector<v1::PlacementMap> PlacementService::maps_for_resume(const v1::JobSpec& spec, const ShapeKey& key,
                                                                const v1::CheckpointManifest& ck,
                                                                const std::string& origin) {
  Shape& s = shape_for_job(spec, key);
  const bool same_shape = ck.world_size() == key.ranks() && ck.devices_per_node() == key.devices_per_node;
  std::vector<ExpertMap> maps;
  for (int l = 0; l < key.layers; ++l) {
    if (same_shape) {
      maps.push_back(checked_map(ck.maps(l)));
      continue;
    }
    std::vector<double> loads(key.experts, 1.0);
    if (l < ck.expert_loads_size() && ck.expert_loads(l).tokens_size() == key.experts) {
      const auto& t = ck.expert_loads(l).tokens();
      if (std::any_of(t.begin(), t.end(), [](double v) { return v > 0; })) loads.assign(t.begin(), t.end());
    }
    maps.push_back(placement::solve_layer(solver_spec(key, s, 0), loads));
  }
  return place(key, s, std::move(maps),
               origin + (same_shape ? " from its checkpoint's maps" : " from its checkpoint's loads"));
}

std::vector<v1::PlacementMap> PlacementService::maps_for_job(const v1::JobSpec& spec, const ShapeKey& key,
                                                             const std::string& origin) {
  Shape& s = shape_for_job(spec, key);
  if (s.maps.empty() || !spread_enough(key, s)) {
    // A shape's first maps, or maps whose copies do not span min_node_replicas
    // nodes: the solver's for uniform load, with the fewest redundant slots the
    // rule needs (docs/placement.md#node-redundancy).
    const int redundant = redundant_for(key, min_nodes_on(key, s.min_node_replicas));
    const ExpertMap first =
        placement::solve_layer(solver_spec(key, s, redundant), std::vector<double>(key.experts, 1.0));
    return place(key, s, std::vector<ExpertMap>(key.layers, first), origin + kUniformStart);
  }
  return s.protos();
}

std::vector<v1::PlacementMap> PlacementService::maps_for_world(const v1::JobSpec& spec, const ShapeKey& old,
                                                               const ShapeKey& next, const std::string& origin) {
  std::vector<std::vector<double>> loads(next.layers, std::vector<double>(next.experts, 1.0));
  if (const auto it = shapes_.find(old); it != shapes_.end())
    for (int l = 0; l < next.layers && l < static_cast<int>(it->second.windows.size()); ++l) {
      const std::vector<double> w = it->second.windows[l].expert_loads();
      if (static_cast<int>(w.size()) == next.experts && std::any_of(w.begin(), w.end(), [](double v) { return v > 0; }))
        loads[l] = w;
    }
  Shape& s = shape_for_job(spec, next);
  const int redundant = redundant_for(next, min_nodes_on(next, s.min_node_replicas));
  std::vector<ExpertMap> maps;
  for (int l = 0; l < next.layers; ++l) maps.push_back(placement::solve_layer(solver_spec(next, s, redundant), loads[l]));
  return place(next, s, std::move(maps), origin);
}

void PlacementService::record_step(const ShapeKey& key, const std::vector<std::vector<double>>& expert,
                                   const std::vector<std::vector<double>>& rank, const std::vector<int64_t>& epochs) {
  const auto it = shapes_.find(key);
  if (it == shapes_.end()) return;
  Shape& s = it->second;
  for (size_t l = 0; l < s.windows.size() && l < expert.size() && l < rank.size() && l < epochs.size(); ++l)
    s.windows[l].add(expert[l], rank[l], epochs[l]);
}

v1::LayerPlacement PlacementService::describe_layer(const Shape& s, int l) const {
  v1::LayerPlacement lp;
  *lp.mutable_map() = spec::to_proto(s.maps[l], l);
  const LoadWindow& w = s.windows[l];
  const std::vector<double> expert = w.expert_loads(), rank = w.rank_loads();
  *lp.mutable_expert_loads() = {expert.begin(), expert.end()};
  *lp.mutable_rank_loads() = {rank.begin(), rank.end()};
  lp.set_window_steps(w.expert_steps());
  lp.set_rank_window_steps(w.rank_steps());
  lp.set_balancedness(w.balancedness());
  if (static_cast<int>(expert.size()) == s.maps[l].num_experts)
    lp.set_predicted_balancedness(placement::balancedness(s.maps[l], expert));
  return lp;
}

v1::PlacementReply PlacementService::describe(ShapeKey key, std::optional<int> layer) const {
  v1::PlacementReply reply;
  for (const auto& [k, s] : shapes_) *reply.add_shapes() = k.proto();
  key = resolve(key);
  if (key.empty()) return reply;  // no job has run: nothing is placed yet
  const Shape& s = find(key);
  *reply.mutable_shape() = key.proto();
  if (layer && (*layer < 0 || *layer >= key.layers))
    throw InvalidArgument(
                   "layer: must be in [0, " + std::to_string(key.layers) + "), got " + std::to_string(*layer));
  for (int l = 0; l < key.layers; ++l) {
    if (layer && l != *layer) continue;
    *reply.add_layers() = describe_layer(s, l);
    *reply.add_maps() = reply.layers(reply.layers_size() - 1).map();
  }
  return reply;
}

v1::PlacementLoads PlacementService::loads(ShapeKey key) const {
  key = resolve(key);
  if (key.empty()) throw RpcError(v1::ERROR_CODE_NOT_FOUND, "no loads yet: no job has run");
  const Shape& s = find(key);
  v1::PlacementLoads out;
  *out.mutable_shape() = key.proto();
  int steps = 0;
  for (const LoadWindow& w : s.windows) {
    const std::vector<double> e = w.expert_loads();
    *out.add_layers()->mutable_tokens() = {e.begin(), e.end()};
    steps = std::max(steps, w.expert_steps());
  }
  out.set_steps(steps);
  out.set_num_groups(s.num_groups);
  out.set_group_top_k(s.group_top_k);
  out.set_top_k(s.top_k);
  return out;
}

RebalancePlan PlacementService::plan(ShapeKey key, std::optional<int> redundant, std::optional<int> layer) const {
  key = resolve(key);
  if (key.empty()) throw RpcError(v1::ERROR_CODE_NOT_FOUND, "nothing to rebalance: no job has run yet");
  const Shape& s = find(key);
  const int current = s.maps[0].num_slots() - key.experts;
  const int n = redundant.value_or(current);
  if (n < 0) throw InvalidArgument("redundant_experts: must be >= 0, got " + std::to_string(n));
  if ((key.experts + n) % key.ranks() != 0)
    throw InvalidArgument(
                   "redundant_experts: experts + redundant (" + std::to_string(key.experts) + " + " +
                       std::to_string(n) + ") must be divisible by the ranks (" + std::to_string(key.ranks()) + ")");
  if (layer && (*layer < 0 || *layer >= key.layers))
    throw InvalidArgument(
                   "layer: must be in [0, " + std::to_string(key.layers) + "), got " + std::to_string(*layer));
  RebalancePlan p{.shape = key, .redundant = n};
  const placement::PlacementSpec spec = solver_spec(key, s, n);
  for (int l = 0; l < key.layers; ++l) {
    if (layer && l != *layer) continue;
    std::vector<double> loads = s.windows[l].expert_loads();
    if (static_cast<int>(loads.size()) != key.experts) loads.assign(key.experts, 1.0);  // nothing measured yet
    const ExpertMap& old = s.maps[l];
    placement::LayerContext ctx;
    if (n == current) ctx.current = &old;  // keep copies in place
    ExpertMap next = placement::keep_local_slots(old, placement::solve_layer(spec, loads, ctx));
    next.epoch = 0;  // the epoch is reserved when the plan is carried out
    p.maps.push_back(spec::to_proto(next, l));
    p.before.push_back(s.windows[l].rank_steps() > 0 ? s.windows[l].balancedness()
                                                     : placement::balancedness(old, loads));
    p.predicted.push_back(placement::balancedness(next, loads));
    for (const ExpertCopy& c : placement::copies_between(old, next, key.devices_per_node)) {
      v1::ExpertCopy& pc = p.copies.emplace_back();
      pc.set_layer(l);
      pc.set_expert(c.expert);
      pc.set_from_rank(c.from_rank);
      pc.set_to_rank(c.to_rank);
      pc.set_to_slot(c.to_slot);
    }
  }
  return p;
}

int64_t PlacementService::install(ShapeKey key, std::vector<v1::PlacementMap> maps, int64_t epoch,
                                  const std::string& origin) {
  key = resolve(key);
  find(key);  // NOT_FOUND for a shape never placed
  Shape& s = shapes_.at(key);
  std::vector<ExpertMap> checked;
  for (const v1::PlacementMap& m : maps) {
    const std::string where = "layer " + std::to_string(m.layer()) + ": ";
    if (m.layer() < 0 || m.layer() >= key.layers)
      throw InvalidArgument(where + "no such layer in the shape " + key.name());
    if (m.num_experts() != key.experts || m.num_ranks() != key.ranks())
      throw InvalidArgument(
                     where + "the map has " + std::to_string(m.num_experts()) + " experts on " +
                         std::to_string(m.num_ranks()) + " ranks, the shape " + key.name());
    if ((m.num_ranks() * m.slots_per_rank()) % key.ranks() != 0 || m.num_ranks() * m.slots_per_rank() < key.experts)
      throw InvalidArgument(where + "experts + redundant must fill every rank's slots");
    try {
      checked.push_back(spec::from_proto(m));
      placement::validate_layer_map(checked.back(), solver_spec(key, s, checked.back().num_slots() - key.experts));
    } catch (const moe::Error& e) {
      throw InvalidArgument(where + e.what());
    }
  }
  if (epoch <= 0) epoch = ++epoch_;
  s.origin = origin;
  for (size_t i = 0; i < maps.size(); ++i) {
    const int l = maps[i].layer();
    checked[i].epoch = epoch;
    s.maps[l] = std::move(checked[i]);
    s.windows[l].restart_ranks(epoch);
  }
  return epoch;
}

void PlacementService::reset(ShapeKey key) {
  key = resolve(key);
  find(key);  // NOT_FOUND for a shape never placed
  shapes_.erase(key);
  if (last_shape_ == key) last_shape_ = ShapeKey{};
}

bool PlacementService::carries_state(const ShapeKey& key) const {
  const auto it = shapes_.find(key);
  if (it == shapes_.end() || it->second.maps.empty()) return false;
  const Shape& s = it->second;
  return !std::string_view(s.origin).ends_with(kUniformStart) || s.maps[0].num_slots() != key.experts;
}

std::string PlacementService::summary(const ShapeKey& key) const {
  const auto it = shapes_.find(key);
  if (it == shapes_.end() || it->second.maps.empty()) return "";
  const Shape& s = it->second;
  int64_t epoch = 0;
  for (const ExpertMap& m : s.maps) epoch = std::max<int64_t>(epoch, m.epoch);
  std::string out = "shape " + key.flag() + ", epoch " + std::to_string(epoch) + ", " + std::to_string(s.maps[0].slots_per_rank) + " slots per rank (" +
                    std::to_string(s.maps[0].num_slots() - key.experts) + " redundant)";
  if (s.min_node_replicas > 1) out += ", min_node_replicas " + std::to_string(s.min_node_replicas);
  return out + (s.origin.empty() ? "" : ", from " + s.origin);
}

std::vector<v1::PlacementMap> PlacementService::maps(const ShapeKey& key) const {
  const auto it = shapes_.find(key);
  return it == shapes_.end() ? std::vector<v1::PlacementMap>{} : it->second.protos();
}

std::vector<double> PlacementService::live_balancedness() const {
  std::vector<double> out;
  const auto it = shapes_.find(last_shape_);
  if (it != shapes_.end())
    for (const LoadWindow& w : it->second.windows) out.push_back(w.balancedness());
  return out;
}

std::vector<double> PlacementService::live_predicted() const {
  std::vector<double> out;
  const auto it = shapes_.find(last_shape_);
  if (it == shapes_.end()) return out;
  for (size_t l = 0; l < it->second.maps.size(); ++l) out.push_back(describe_layer(it->second, static_cast<int>(l)).predicted_balancedness());
  return out;
}

v1::PlacementState PlacementService::state() const {
  v1::PlacementState st;
  st.set_epoch(epoch_);
  *st.mutable_last_shape() = last_shape_.proto();
  for (const auto& [key, s] : shapes_) {
    v1::ShapePlacement* sp = st.add_shapes();
    *sp->mutable_shape() = key.proto();
    for (const v1::PlacementMap& m : s.protos()) *sp->add_maps() = m;
    sp->set_num_groups(s.num_groups);
    sp->set_top_k(s.top_k);
    sp->set_group_top_k(s.group_top_k);
    sp->set_min_node_replicas(s.min_node_replicas);
    sp->set_origin(s.origin);
    for (const LoadWindow& w : s.windows) {
      v1::LoadWindowState* ws = sp->add_windows();
      for (const auto& e : w.expert_steps_data()) *ws->add_expert_steps()->mutable_tokens() = {e.begin(), e.end()};
      for (const auto& r : w.rank_steps_data()) *ws->add_rank_steps()->mutable_tokens() = {r.begin(), r.end()};
      ws->set_rank_epoch(w.rank_epoch());
    }
  }
  return st;
}

void PlacementService::restore(const v1::PlacementState& st) {
  epoch_ = st.epoch();
  last_shape_ = ShapeKey::of(st.last_shape());
  shapes_.clear();
  for (const v1::ShapePlacement& sp : st.shapes()) {
    Shape& s = shapes_[ShapeKey::of(sp.shape())];
    for (const v1::PlacementMap& m : sp.maps()) s.maps.push_back(spec::from_proto(m));
    s.num_groups = sp.num_groups();
    s.top_k = sp.top_k();
    s.group_top_k = sp.group_top_k();
    s.min_node_replicas = sp.min_node_replicas();
    s.origin = sp.origin();
    s.windows.assign(s.maps.size(), LoadWindow(window_steps_));
    for (int l = 0; l < sp.windows_size() && l < static_cast<int>(s.windows.size()); ++l) {
      std::deque<std::vector<double>> expert, rank;
      for (const auto& e : sp.windows(l).expert_steps()) expert.emplace_back(e.tokens().begin(), e.tokens().end());
      for (const auto& r : sp.windows(l).rank_steps()) rank.emplace_back(r.tokens().begin(), r.tokens().end());
      s.windows[l].restore(std::move(expert), std::move(rank), sp.windows(l).rank_epoch());
    }
  }
}

}  // namespace moe::agent
