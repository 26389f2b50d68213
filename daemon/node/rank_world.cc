#include "rank_world.h"

#include "moe/spec/expert_map_codec.h"

namespace moe::node {
namespace {

std::vector<moe::ExpertMap> expert_maps(const v1::StartJob& job) {
  std::vector<moe::ExpertMap> maps;
  for (const auto& m : job.maps()) maps.push_back(spec::from_proto(m));
  return maps;
}

// The memory the rank's backend computes in: the transport factory gives a CUDA
// job's ranks a communicator for it (NCCL) beside the host one.
transport::DataMemory data_memory(const kernels::Backend& be) {
  return be.name() == "cuda" ? transport::DataMemory::kCuda : transport::DataMemory::kHost;
}

}  // namespace

RankWorld::RankWorld(v1::StartJob s, int r, const RankWorldEnv& e)
    : start(std::move(s)),
      rank(r),
      boot(e.agent, start.job_id(), rank, start.world_epoch()),
      transports(transport::make_rank_transports({.rank = rank,
                                                  .world = start.world_size(),
                                                  .local = e.runner.worlds().hub(start.world_epoch()),
                                                  .bootstrap = &boot,
                                                  .data_memory = data_memory(e.backend),
                                                  .device = e.local,
                                                  .connect_timeout = e.env.transport_timeout,
                                                  .job_key = start.data_plane_key()})),
      comm(*transports.host),
      stack(start.spec(), expert_maps(start), rank, start.world_size(), comm, e.backend, e.pool,
            e.env.transport_timeout, transports.data.get()),
      rebalance({.job_id = start.job_id(),
                 .node_name = e.env.node_name,
                 .rank = rank,
                 .world = start.world_size(),
                 .faults = e.env.faults,
                 .metrics = e.env.metrics},
                stack, e.runner.rebalance_mailbox(), e.agent) {}

void RankWorld::abort(const std::string& why) {
  if (transports.data) transports.data->abort(why);
  comm.abort(why);
}

}  // namespace moe::node
