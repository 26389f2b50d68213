// The live-load reply of `moectl top` (docs/metrics.md#live-load): the running job
// (or the last one) with its recent step time, the last job's shape per layer (epoch, window
// balancedness, rank and expert loads), node and job counts. A pure function of
// the agent's rooms, read on the io thread; before any job the reply has no job,
// no shape and no layers.
#pragma once

#include "moe/cluster/membership.h"
#include "moe/cluster/placement_service.h"
#include "moe/jobs/scheduler.h"
#include "moe/v1/live_load.pb.h"

namespace moe::agent {

// window_capacity: the agent's --load-window, in steps.
v1::LiveLoad live_load(const Membership& members, const Scheduler& scheduler, const PlacementService& placement,
                       int window_capacity);

}  // namespace moe::agent
