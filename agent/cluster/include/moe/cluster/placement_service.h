// The placement service: expert placement as cluster state
// (docs/placement.md#cluster-state), like Ceph's OSDMap. Per shape (experts,
// layers, nodes, devices per node) and layer it keeps the epoch-numbered map in
// force and the sliding window of measured load; a job starts on its shape's
// current maps; a rebalance plans new maps from the window and installs them
// under a new epoch. Epochs only grow, cluster-wide. It holds the maps as
// moe::ExpertMap and converts at its edge: protos in (checked) and out. No I/O.
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "moe/cluster/load_window.h"
#include "moe/placement/placement_map.h"
#include "moe/v1/agent_state.pb.h"
#include "moe/v1/checkpoint.pb.h"
#include "moe/v1/placement.pb.h"
#include "moe/v1/rebalance.pb.h"
#include "moe/v1/job.pb.h"

namespace moe::agent {

struct ShapeKey {
  int experts = 0, layers = 0, nodes = 0, devices_per_node = 0;
  auto operator<=>(const ShapeKey&) const = default;
  int ranks() const { return nodes * devices_per_node; }
  bool empty() const { return experts == 0; }
  static ShapeKey of(const v1::PlacementShape& s);
  v1::PlacementShape proto() const;
  std::string name() const;  // "64 experts x 2 layers on 2x2"
  std::string flag() const;  // "64x2@2x2", as moectl's --shape takes it
};

// What a rebalance would install: the changed layers' new maps (epoch 0 until
// installed), the window's balancedness before and the prediction after, and
// the expert copies ranks need (bytes 0: they depend on the job).
struct RebalancePlan {
  ShapeKey shape;
  int redundant = 0;
  std::vector<v1::PlacementMap> maps;
  std::vector<double> before, predicted;
  std::vector<v1::ExpertCopy> copies;
};

class PlacementService {
 public:
  explicit PlacementService(int window_steps = 32) : window_steps_(window_steps) {}

  // The maps a job of `shape` starts on, one per layer: the shape's current
  // maps; for a shape seen the first time, the solver's map for uniform load
  // under a new epoch. Throws moe::Error when the solver refuses the sizes.
  // `origin` says what asked ("job-4"), for summary().
  std::vector<v1::PlacementMap> maps_for_job(const v1::JobSpec& spec, const ShapeKey& shape,
                                             const std::string& origin = "");
  // The maps a job resuming from a checkpoint starts on
  // (docs/jobs.md#checkpoints-and-resume), under a new epoch: on the checkpoint's
  // cluster shape its maps; on another, the solver's from the checkpoint's
  // measured loads.
  std::vector<v1::PlacementMap> maps_for_resume(const v1::JobSpec& spec, const ShapeKey& shape,
                                                const v1::CheckpointManifest& checkpoint, const std::string& origin = "");
  // An elastic job's new world (docs/jobs.md#elastic-jobs): maps for `next`
  // solved from the loads `old` measured (uniform where it measured none), with
  // the fewest redundant slots the job's min_node_replicas needs on `next`,
  // installed as `next`'s maps under a new epoch.
  std::vector<v1::PlacementMap> maps_for_world(const v1::JobSpec& spec, const ShapeKey& old, const ShapeKey& next,
                                               const std::string& origin = "");
  // One complete step of a job: per layer, pairs per logical expert (summed
  // over ranks), pairs per rank, and the epoch the layer ran under.
  void record_step(const ShapeKey& shape, const std::vector<std::vector<double>>& expert,
                   const std::vector<std::vector<double>>& rank, const std::vector<int64_t>& epochs);

  // `placement show`: an empty shape means the last job's (an empty reply before
  // any job). Throws rpc::RpcError(NOT_FOUND) for a shape never placed, and
  // INVALID_ARGUMENT for a layer out of range.
  v1::PlacementReply describe(ShapeKey shape, std::optional<int> layer) const;
  v1::PlacementLoads loads(ShapeKey shape) const;
  // New maps from the window's expert loads, keeping copies in place where the
  // slot count stays (pure). redundant defaults to the shape's current count.
  // Throws moe::InvalidArgument naming the rule a request breaks.
  RebalancePlan plan(ShapeKey shape, std::optional<int> redundant, std::optional<int> layer) const;
  // Installs maps (each with its layer set) under a new epoch (or `epoch`, one
  // reserve_epoch() returned) and returns it. Throws rpc::RpcError
  // (INVALID_ARGUMENT) naming what does not fit the shape.
  // `origin` names what installs them ("a rebalance of job-4", "placement import").
  int64_t install(ShapeKey shape, std::vector<v1::PlacementMap> maps, int64_t epoch = 0,
                  const std::string& origin = "");
  // Forgets a shape's maps, load window and node redundancy: its next job starts
  // as on a shape never placed. Throws rpc::RpcError(NOT_FOUND) for a shape never
  // placed. Epochs still only grow.
  void reset(ShapeKey shape);
  // "shape 8x1@2x1, epoch 9, 8 slots per rank (4 redundant), min_node_replicas
  // 2, from job-3's world change": the shape's maps in force and what installed them; "" for a
  // shape never placed.
  std::string summary(const ShapeKey& shape) const;
  // Whether the shape's maps are other than a shape never placed would get (the
  // solver's for uniform load, no redundant slots): redundancy, a rebalance, a
  // world change, an import or a checkpoint's maps that its next job inherits.
  bool carries_state(const ShapeKey& shape) const;
  // The next epoch number, for a live rebalance that installs it only if it
  // commits (an aborted one leaves a gap: epochs only grow).
  int64_t reserve_epoch() { return ++epoch_; }

  ShapeKey resolve(ShapeKey shape) const { return shape.empty() ? last_shape_ : shape; }
  ShapeKey last_shape() const { return last_shape_; }
  int64_t epoch() const { return epoch_; }
  // The shape's maps in force, one per layer (none for a shape never placed).
  std::vector<v1::PlacementMap> maps(const ShapeKey& shape) const;
  // Of the last job's shape, per layer: measured and predicted balancedness.
  std::vector<double> live_balancedness() const;
  std::vector<double> live_predicted() const;

  v1::PlacementState state() const;
  void restore(const v1::PlacementState& s);

 private:
  struct Shape {
    std::vector<ExpertMap> maps;  // by layer, each with its epoch
    std::vector<LoadWindow> windows;
    int num_groups = 0, top_k = 0, group_top_k = 0;  // the last job's routing, for the solver
    int min_node_replicas = 0;                        // ... and its node redundancy as asked (0: unset)
    std::string origin;                               // what installed the maps in force
    std::vector<v1::PlacementMap> protos() const;    // the maps as they go on the wire
  };
  const Shape& find(const ShapeKey& shape) const;  // throws NOT_FOUND
  Shape& shape_for_job(const v1::JobSpec& spec, const ShapeKey& shape);  // creates it, notes the routing
  bool spread_enough(const ShapeKey& key, const Shape& s) const;  // its maps honour its min_node_replicas
  // Its installed maps, all under a new epoch, and fresh load windows.
  std::vector<v1::PlacementMap> place(const ShapeKey& key, Shape& s, std::vector<ExpertMap> maps,
                                      const std::string& origin);
  placement::PlacementSpec solver_spec(const ShapeKey& key, const Shape& s, int redundant) const;
  v1::LayerPlacement describe_layer(const Shape& s, int layer) const;

  int window_steps_;
  std::map<ShapeKey, Shape> shapes_;
  ShapeKey last_shape_;
  int64_t epoch_ = 0;
};

}  // namespace moe::agent
