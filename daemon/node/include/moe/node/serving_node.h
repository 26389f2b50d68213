// A serving job's state on one node (docs/serving.md): the queued rows of the
// calls, the requests that are not rows (optimizer steps, weight reads), the
// rows kept for backward calls, the node's limits on them, and its calls'
// statistics. The daemon's
// RPC thread adds to it; the node's ranks serve it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "moe/layer_spec/job_layers.h"
#include "moe/node/serve_handles.h"
#include "moe/node/serve_queue.h"
#include "moe/node/serve_requests.h"
#include "moe/node/serve_stats.h"

namespace moe::node {

struct ServeLimits {
  int64_t call_rows;    // a call: one step of the node's ranks, and what fits a frame
  int64_t queued_rows;  // waiting on the node: 8 steps, at most 256 MiB of them
  size_t handle_bytes;  // rows kept for backward calls: 1 GiB
  std::chrono::seconds handle_ttl;  // a kept row's life: 10 minutes
};
ServeLimits serve_limits(const layer_spec::JobView& job, int devices);

class ServingNode {
 public:
  ServingNode(const layer_spec::JobView& job, int devices);
  // The job ends on this node: every waiting call and request fails with `why`.
  void close(const std::string& why);

  const ServeLimits limits;
  ServeQueue queue;
  ServeRequests requests;
  ServeHandles handles;
  ServeStats stats;
};

}  // namespace moe::node
