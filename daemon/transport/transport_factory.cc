#include "moe/transport/transport_factory.h"

#include "moe/transport/inproc_communicator.h"
#include "moe/transport/ucx_communicator.h"
#ifdef MOE_WITH_NCCL
#include "moe/transport/nccl_communicator.h"
#endif

namespace moe::transport {
namespace {

bool all_local(const RankTransportSpec& s) {
  if (!s.local) return s.world == 1;
  for (int r = 0; r < s.world; ++r)
    if (!s.local->is_local(r)) return false;
  return true;
}

// The bytes rank 0 makes for the data communicator's group (relayed beside the
// host communicator's own).
std::string data_root_blob(const RankTransportSpec& s) {
  switch (s.data_memory) {
    case DataMemory::kHost: return {};
    case DataMemory::kCuda:
#ifdef MOE_WITH_NCCL
      return s.rank == 0 ? NcclCommunicator::make_unique_id() : std::string();
#else
      break;
#endif
  }
  detail::fail("transport: CUDA memory needs NCCL, and this build has no CUDA");
}

// boot: null only when every rank is local.
std::unique_ptr<Communicator> make_host(const RankTransportSpec& s, Bootstrap* boot) {
  if (all_local(s)) {
    std::shared_ptr<LocalHub> hub = s.local ? s.local : std::make_shared<LocalHub>(std::vector<int>{s.rank});
    return std::make_unique<InProcCommunicator>(std::move(hub), s.rank, s.world);
  }
  UcxOptions o;
  o.hub = s.local;
  o.connect_timeout = s.connect_timeout;
  o.job_key = s.job_key;
  return std::make_unique<UcxCommunicator>(s.rank, s.world, *boot, o);
}

std::unique_ptr<Communicator> make_data(const RankTransportSpec& s, const std::string& root_blob) {
  switch (s.data_memory) {
    case DataMemory::kHost: return nullptr;
    case DataMemory::kCuda:
#ifdef MOE_WITH_NCCL
      return std::make_unique<NcclCommunicator>(s.rank, s.world, s.device, root_blob,
                                                deadline_in(s.connect_timeout));
#else
      (void)root_blob;
      break;
#endif
  }
  detail::fail("transport: CUDA memory needs NCCL, and this build has no CUDA");
}

}  // namespace

RankTransports make_rank_transports(const RankTransportSpec& s) {
  MOE_CHECK(s.world >= 1 && s.rank >= 0 && s.rank < s.world, "transport: rank ", s.rank, " of ", s.world);
  MOE_CHECK(!s.local || s.local->is_local(s.rank), "transport: rank ", s.rank, " is not in its local hub");
  RankTransports t;
  if (!s.bootstrap) {
    MOE_CHECK(all_local(s) && s.data_memory == DataMemory::kHost, "transport: rank ", s.rank,
              " has remote peers or device memory but no bootstrap");
    t.host = make_host(s, nullptr);
    return t;
  }
  // A given bootstrap always sees one round from every rank: it carries every
  // rank's host bytes (none for an in-process host) and rank 0's data blob.
  RootBlobBootstrap boot(*s.bootstrap, s.rank, data_root_blob(s));
  t.host = make_host(s, &boot);
  if (all_local(s)) boot.all_gather({});
  t.data = make_data(s, boot.root_blob());
  return t;
}

}  // namespace moe::transport
