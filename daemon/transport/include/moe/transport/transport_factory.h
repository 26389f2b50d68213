// The one place that decides which communicators a rank of a job gets
// (docs/transport.md#choosing-a-transport), the way NCCL picks a transport per
// peer:
//   host  (host memory: counts, control, expert copies): in-process through the
//         process's LocalHub when every rank of the world is local, else UCX,
//         whose local peers still go through the hub.
//   data  (the backend's memory: the dispatcher's all-to-alls, the replicated
//         weights' all-reduce): NCCL for CUDA memory; none for host memory, where
//         the host communicator carries it.
// A new transport is its own files plus its line here.
#pragma once

#include <chrono>
#include <memory>

#include "moe/transport/bootstrap.h"
#include "moe/transport/communicator.h"
#include "moe/transport/local_hub.h"

namespace moe::transport {

// The memory a rank's backend computes in.
enum class DataMemory { kHost, kCuda };

struct RankTransportSpec {
  int rank = 0;
  int world = 1;
  // This process's ranks (null: only this one). Every rank of one process must
  // share the same hub.
  std::shared_ptr<LocalHub> local;
  // Swaps connection bytes with every rank of the world (one round from every
  // rank, whatever the choice); may be null only when every rank is local and
  // the data memory is the host's.
  Bootstrap* bootstrap = nullptr;
  DataMemory data_memory = DataMemory::kHost;
  int device = 0;  // the rank's GPU, for kCuda
  std::chrono::milliseconds connect_timeout{30000};
  std::string job_key;  // StartJob.data_plane_key: UCX peers prove it at wire-up
};

struct RankTransports {
  std::unique_ptr<Communicator> host;
  std::unique_ptr<Communicator> data;  // null: host carries the backend's memory
};

// Collective over the world: every rank calls it with its own spec. Throws
// moe::Error naming what cannot be built here (e.g. CUDA memory in a build
// without NCCL), TransportError when a peer does not connect in time.
RankTransports make_rank_transports(const RankTransportSpec& spec);

}  // namespace moe::transport
