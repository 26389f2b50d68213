// Internal to the solver: an assignment of expert replicas to rank slots and
// the steps that build and improve it. Not part of the public API.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moe/placement/placement_map.h"

namespace moe::placement::detail {

// Throws moe::Error unless loads has one entry per expert of spec, each
// finite and non-negative.
void check_loads(const PlacementSpec& spec, std::span<const double> loads);

// Slots of ranks; phy2log[slot] == -1 while a slot is empty. unit[e] is the
// load one replica of e carries (loads[e] / replicas[e]).
class Packing {
 public:
  Packing(const PlacementSpec& spec, std::span<const double> unit);

  int num_ranks() const { return num_ranks_; }
  int num_nodes() const { return num_nodes_; }
  int slots_per_rank() const { return slots_per_rank_; }
  int node_of_rank(int rank) const { return rank / ranks_per_node_; }
  int rank_of_slot(int slot) const { return slot / slots_per_rank_; }
  double unit(int expert) const { return unit_[expert]; }
  double rank_load(int rank) const { return load_[rank]; }
  int free_slots(int rank) const { return slots_per_rank_ - fill_[rank]; }
  int32_t expert_at(int slot) const { return phy2log_[slot]; }
  const std::vector<int32_t>& phy2log() const { return phy2log_; }
  double max_load() const;

  // Copies of expert on rank.
  int copies_on(int rank, int expert) const;
  // Puts expert into the rank's first empty slot (the rank must have one).
  void place(int rank, int expert);
  // Puts expert into an empty slot.
  void place_at(int slot, int expert);
  // Exchanges the contents of two slots.
  void swap_slots(int a, int b);

 private:
  int num_ranks_, num_nodes_, slots_per_rank_, ranks_per_node_;
  std::span<const double> unit_;
  std::vector<int32_t> phy2log_;
  std::vector<double> load_;
  std::vector<int> fill_;
};

// Expert groups' home nodes (groups as PlacementSpec::group_of numbers them;
// one group when the spec has none).
struct Locality {
  std::vector<uint8_t> home;  // [G, N]: 1 where node n is a home of group g
};

// Home nodes for the groups of spec: groups are packed onto nodes by load,
// whole groups first (balanced packing); with fewer groups than nodes, each
// group gets a contiguous block of nodes.
Locality make_locality(const PlacementSpec& spec, std::span<const double> loads);

// Greedy packing, heaviest replica first (ties: lower expert). Each replica
// goes to the least-loaded rank with a free slot among its group's nodes if
// it fits under cap there, else to the least-loaded rank with a free slot
// anywhere, whose node then joins the group's nodes. Unless allow_copies, a
// rank that already holds the expert is taken only when nothing else has room.
Packing greedy_pack(const PlacementSpec& spec, std::span<const double> unit,
                    std::span<const int> replicas, const Locality& locality, double cap,
                    bool allow_copies);

// Spreads the replicas of a node-level packing (made for node_spec: one
// "rank" per node) over each node's ranks of spec: heaviest first onto the
// node's least-loaded rank with a free slot, avoiding a second copy of an
// expert on a rank where the node allows it.
Packing unfold_nodes(const PlacementSpec& spec, const Packing& node_packing,
                     std::span<const double> unit);

// The node-level problem of spec: one rank per node, as many slots.
PlacementSpec node_level_spec(const PlacementSpec& spec);

// Local search on the most loaded rank: swaps one of its replicas with a
// lighter one elsewhere while that lowers the pair's larger load; stops when
// no swap does, or after max_swaps. With same_node_only it does this inside
// every node on its own (node contents, hence fan-out, stay as they are).
void reduce_max_load(Packing& packing, bool same_node_only, int max_swaps);

}  // namespace moe::placement::detail
