// Communicator over NCCL (docs/transport.md#nccl): ranks are GPUs, one per process and rank.
//
// Memory: every data pointer given to all_to_all_v, all_reduce_sum, send, recv,
// isend and irecv is DEVICE memory on this communicator's device. exchange_counts
// alone takes HOST arrays (int64_t[size()]), staged through a small device buffer.
//
// The NCCL communicator is non-blocking (config.blocking = 0): no NCCL call blocks
// the thread, and every wait polls NCCL's asynchronous state and the CUDA stream
// until the operation finished or its deadline passed. On an NCCL error or a
// deadline the communicator is aborted (ncclCommAbort, which also stops kernels
// still waiting for a peer), and from then on every call throws TransportError
// ("communicator was aborted: <first reason>") at once, never hangs.
//
// Peers: NCCL reports neither which rank failed nor which one it waits for, so the
// errors of collectives name peer -1; point-to-point errors name their peer.
//
// Point-to-point: NCCL does not match tags. Messages between a pair of ranks match
// in posting order, so the callers must post matching send/recv pairs in the same
// order on both ranks (moe's callers do); the tag is accepted and not checked.
// Blocking send/recv to this rank itself is refused (NCCL pairs a send to self only
// with a receive posted in the same group); isend/irecv to self work.
// Zero-byte messages and segments move nothing and complete at once on both sides.
//
// Background transfers (isend/irecv) are queued and issued together as ONE NCCL
// group on a second stream at this communicator's next test() or blocking call,
// so every rank places them at the same point of its sequence of NCCL operations
// and a pair exchanging data both ways cannot deadlock. The two ranks of a
// transfer must therefore post it between the same two blocking calls of their
// sequences (as StagedExperts does: every rank posts its copies at one step).
//
// Threads: one thread drives a communicator; abort() and aborted() alone may be
// called from any thread (e.g. when the agent reports a dead peer while the rank
// thread waits).
//
// Multi-rank behaviour needs several GPUs (two ranks cannot share one GPU); the
// tests in tests/gpu/nccl_test.cc run one rank.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "moe/transport/communicator.h"

namespace moe::transport {

// Faults inject_fault() can make an operation suffer.
enum class NcclFault {
  kError,  // NCCL reports an asynchronous error (as when a peer dies)
  kStall,  // the operation never completes (as when a peer never posts its side)
};

class NcclCommunicator final : public Communicator {
 public:
  // A new ncclUniqueId (NCCL_UNIQUE_ID_BYTES = 128 bytes) for rank 0 to hand to
  // every rank of the group (through the agent's bootstrap relay).
  static std::string make_unique_id();

  // Joins the group `unique_id` names as `rank` of `size`, on CUDA device
  // `device`. Every rank must call it; throws TransportError ("nccl init: ...")
  // when NCCL fails or the group is not complete by `init_deadline`.
  NcclCommunicator(int rank, int size, int device, const std::string& unique_id, Deadline init_deadline);
  // Destroys the NCCL communicator (aborts it when broken, or when background
  // transfers are still in flight) and frees its buffers and streams.
  ~NcclCommunicator() override;

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "nccl"; }
  int device() const { return device_; }

  using Communicator::all_to_all_v;
  // Device buffers. One NCCL group of ncclSend/ncclRecv for all buffers; the self
  // segment is a device-to-device copy.
  void all_to_all_v(const std::vector<AllToAllBuffer>& buffers, Deadline deadline) override;
  // HOST arrays of size() entries.
  void exchange_counts(const int64_t* send, int64_t* recv, Deadline deadline) override;
  // Device array. ncclAllGather into a [size(), count] workspace, then a kernel
  // sums element i over ranks 0..R-1 in order: the same bits on every rank.
  void all_reduce_sum(float* data, size_t count, Deadline deadline) override;
  void barrier(Deadline deadline) override;
  // Device buffers; peer != rank(). The tag is not matched (see above).
  void send(int peer, const void* data, size_t bytes, uint32_t tag, Deadline deadline) override;
  void recv(int peer, void* data, size_t bytes, uint32_t tag, Deadline deadline) override;
  // Device buffers; peer may be rank(). Issued at the next test() or blocking
  // call (see above); the buffer must stay valid until test() returns true.
  TransferId isend(int peer, const void* data, size_t bytes, uint32_t tag,
                   std::shared_ptr<const void> keep = {}) override;
  TransferId irecv(int peer, void* data, size_t bytes, uint32_t tag, std::shared_ptr<const void> keep = {}) override;
  bool test(TransferId id) override;

  // Aborts the communicator because of `why` (e.g. "rank 3 died", from the agent):
  // a wait in progress on another thread throws, and so does every later call.
  // Does nothing when already aborted. Thread-safe.
  void abort(const std::string& why) override;
  bool aborted() const;

  // Test hook: the blocking operation (all_to_all_v, exchange_counts,
  // all_reduce_sum, barrier, send, recv) `after_calls` calls from now suffers
  // `fault` once: kError fails it as an NCCL error would, kStall holds its stream
  // until its deadline passes. Either way the real abort path runs.
  void inject_fault(NcclFault fault, int after_calls = 0);

 private:
  struct Impl;
  const int rank_, size_, device_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::transport
