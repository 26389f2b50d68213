// The placement service: the per-layer, epoch-numbered expert maps (DESIGN 7)
// the agent hands to jobs, and the one place that converts between the solver's
// maps (moe/placement) and their protos. Epochs only grow.
#pragma once

#include <cstdint>
#include <vector>

#include "moe/placement/placement_map.h"
#include "moe/v1/cluster.pb.h"
#include "moe/v1/job.pb.h"

namespace moe::agent {

class PlacementService {
 public:
  // The maps a job starts on, one per layer, under a new epoch: the solver's map
  // for uniform loads (no measured loads, no redundant experts yet). Throws
  // moe::Error when the solver refuses the sizes.
  const std::vector<v1::PlacementMap>& maps_for_job(const v1::JobSpec& spec, int world, int num_nodes);
  // Per layer, tokens per logical expert measured by the last job.
  void record_loads(std::vector<std::vector<double>> expert_tokens);

  int64_t epoch() const { return epoch_; }
  const std::vector<v1::PlacementMap>& maps() const { return maps_; }
  // Balancedness of layer l's map under the last measured loads (0 before any).
  double balancedness(int layer) const;

  static v1::PlacementMap to_proto(const placement::LayerMap& m, int layer, int64_t epoch);
  // Throws moe::Error naming the first inconsistency of the message.
  static placement::LayerMap from_proto(const v1::PlacementMap& m);

 private:
  int64_t epoch_ = 0;
  std::vector<v1::PlacementMap> maps_;
  std::vector<std::vector<double>> loads_;
};

}  // namespace moe::agent
