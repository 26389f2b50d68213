// Communicator over UCX (ucp tag matching), host memory. One worker per rank,
// endpoints to every peer from the worker addresses a Bootstrap hands out, in
// UCP_ERR_HANDLING_MODE_PEER so a dead peer fails the endpoint instead of hanging.
// Peers in the same process (a daemon's own ranks, named by a LocalHub) are
// reached in-process through the hub instead: one memcpy, no UCX.
//
// Waits are event-driven: progress the worker, ucp_worker_arm, then epoll on the
// worker's event fd until something happens or the deadline passes. Ranks share
// cores, so nothing spins.
//
// Not thread-safe: one thread drives a communicator (the worker is single-threaded).
// After a TransportError the communicator is broken: every later call throws.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "moe/transport/bootstrap.h"
#include "moe/transport/communicator.h"
#include "moe/transport/local_hub.h"

namespace moe::transport {

struct UcxOptions {
  // Set UCX_MM_ERROR_HANDLING=y unless the environment says otherwise, so shared
  // memory stays usable in PEER error mode (else loopback runs over tcp).
  bool allow_shared_memory = false;
  // Deadline of the wire-up barrier inside the constructor.
  std::chrono::milliseconds connect_timeout{30000};
  // Ranks of this process; null: every peer is remote.
  std::shared_ptr<LocalHub> hub;
  // The job's data-plane key (bytes, the same on every rank; docs/transport.md#job-key).
  // Every peer proves it holds it at wire-up, or the communicator fails naming the peer.
  std::string job_key;
};

class UcxCommunicator final : public Communicator {
 public:
  UcxCommunicator(int rank, int size, Bootstrap& bootstrap, const UcxOptions& options = {});
  ~UcxCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "ucx"; }

  using Communicator::all_to_all_v;
  void all_to_all_v(const std::vector<AllToAllBuffer>& buffers, Deadline deadline) override;
  void all_reduce_sum(float* data, size_t count, Deadline deadline) override;
  void barrier(Deadline deadline) override;
  void send(int peer, const void* data, size_t bytes, uint32_t tag, Deadline deadline) override;
  void recv(int peer, void* data, size_t bytes, uint32_t tag, Deadline deadline) override;
  TransferId isend(int peer, const void* data, size_t bytes, uint32_t tag, std::shared_ptr<const void> keep) override;
  TransferId irecv(int peer, void* data, size_t bytes, uint32_t tag, std::shared_ptr<const void> keep) override;
  bool test(TransferId id) override;
  // The agent saw the group fail: a wait on another thread ends now with `why`
  // (not at UCX's endpoint timeout, which a peer restarted under the same
  // address can stretch to tens of seconds), and so does every later call.
  void abort(const std::string& why) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_, size_;
};

}  // namespace moe::transport
