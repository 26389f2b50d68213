// The copies of a live rebalance (docs/placement.md#live-rebalance), planned next
// to the solver's migration code (migration.cc): which slots keep their expert,
// and which expert each gaining slot copies from whom.
#pragma once

#include <vector>

#include "moe/map/expert_map.h"

namespace moe::placement {

// `next` with each rank's slots reordered so that an expert the rank keeps stays
// in the local slot it had in `current` (the switch then leaves it untouched).
// The same experts on the same ranks: balance and fan-out do not change.
ExpertMap keep_local_slots(const ExpertMap& current, const ExpertMap& next);

// The copies ranks need to go from `current` to `next`: one per slot of an expert
// its rank did not host before (a rank fills further slots of an expert it hosts
// from its own copy), each from a holder on the gaining rank's node if there is
// one (devices_per_node > 0), else the expert's first holder. Throws moe::Error
// when an expert has no holder in `current`.
std::vector<ExpertCopy> copies_between(const ExpertMap& current, const ExpertMap& next, int devices_per_node);

}  // namespace moe::placement
