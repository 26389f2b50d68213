// Ranks that are threads of one process, talking through the process's LocalHub
// (local_hub.h): the same in-process mailbox that UcxCommunicator uses for its
// local peers, here serving every peer. Collectives are the UCX communicator's
// algorithms over the hub's point-to-point messages (so a sum has the same bits
// on either), and waits block on an eventfd the hub signals, never spin.
//
// Not thread-safe (but abort()): one thread drives a communicator. After a TransportError the
// communicator is broken (every later call throws) and it has aborted its rank in
// the hub, so peers waiting on it fail instead of running out their deadline.
#pragma once

#include <memory>
#include <string>

#include "moe/transport/communicator.h"
#include "moe/transport/local_hub.h"

namespace moe::transport {

class InProcCommunicator final : public Communicator {
 public:
  // hub: holds every rank of the group [0, size).
  InProcCommunicator(std::shared_ptr<LocalHub> hub, int rank, int size);
  ~InProcCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "inproc"; }

  using Communicator::all_to_all_v;
  void all_to_all_v(const std::vector<AllToAllBuffer>& buffers, Deadline deadline) override;
  void all_reduce_sum(float* data, size_t count, Deadline deadline) override;
  void barrier(Deadline deadline) override;
  void send(int peer, const void* data, size_t bytes, uint32_t tag, Deadline deadline) override;
  void recv(int peer, void* data, size_t bytes, uint32_t tag, Deadline deadline) override;
  TransferId isend(int peer, const void* data, size_t bytes, uint32_t tag, std::shared_ptr<const void> keep) override;
  TransferId irecv(int peer, void* data, size_t bytes, uint32_t tag, std::shared_ptr<const void> keep) override;
  bool test(TransferId id) override;
  // From another thread (a halted elastic world): the wait in progress and
  // every later call fail with `why`.
  void abort(const std::string& why) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_, size_;
};

// A whole group of in-process ranks over one hub (tests and benchmarks).
class InProcGroup {
 public:
  explicit InProcGroup(int size);
  int size() const { return size_; }
  // The communicator of one rank; call once per rank.
  std::unique_ptr<Communicator> communicator(int rank);
  // Marks `rank` failed: every wait on it throws TransportError naming it.
  void abort(int rank, const std::string& reason);

 private:
  const int size_;
  std::shared_ptr<LocalHub> hub_;
};

}  // namespace moe::transport
