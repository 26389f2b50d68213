#include "moe/node/serving_node.h"

#include <algorithm>

#include "moe/rpc/frame.h"
#include "moe/spec/checkpoint_manifest.h"

namespace moe::node {

ServeLimits serve_limits(const layer_spec::JobView& job, int devices) {
  const int64_t row_bytes = static_cast<int64_t>(kernels::dtype_size(job.dtype)) * job.shape.hidden;
  const int64_t step = job.tokens_per_rank * devices;
  const int64_t frame_rows = static_cast<int64_t>(rpc::kDefaultMaxFrameBytes - (64 << 10)) / row_bytes;
  const int64_t call_rows = std::max<int64_t>(1, std::min(step, frame_rows));
  return {.call_rows = call_rows,
          .queued_rows = std::max(call_rows, std::min(8 * step, (int64_t{256} << 20) / row_bytes)),
          .handle_bytes = size_t{1} << 30,
          .handle_ttl = std::chrono::minutes(10)};
}

ServingNode::ServingNode(const layer_spec::JobView& job, int devices)
    : limits(serve_limits(job, devices)),
      queue(job.layers),
      handles(limits.handle_bytes, limits.handle_ttl),
      stats(job.layers * kServeKinds) {
  // A resumed job's optimizer steps go on from its checkpoint's, before any call is taken.
  if (!job.resume.empty()) requests.resume_at(spec::read_manifest(job.resume).step());
}

void ServingNode::close(const std::string& why) {
  queue.close(why);
  requests.close(why);
}

}  // namespace moe::node
