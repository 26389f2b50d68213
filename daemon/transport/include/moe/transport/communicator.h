// The Communicator: what an EP rank needs from a transport (docs/transport.md#communicator). One
// instance per rank; collectives must be called by every rank of the group in the
// same order. Every wait has a deadline; a failure throws TransportError naming the
// peer (rank) that caused it.
//
// Implementations: InProcCommunicator (ranks are threads of one process, shared
// memory), UcxCommunicator (ranks are processes or nodes; host memory over UCX).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "moe/base/check.h"

namespace moe::transport {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline deadline_in(std::chrono::milliseconds ms) { return Clock::now() + ms; }

// A transport failure. peer is the rank that failed or timed out (-1: none in
// particular, e.g. a local resource error).
class TransportError : public Error {
 public:
  TransportError(int peer, const std::string& what) : Error(what), peer_(peer) {}
  int peer() const { return peer_; }

 private:
  int peer_;
};

// Byte counts of one all-to-all-v, indexed by peer rank.
struct Segments {
  std::vector<size_t> bytes;   // [R]
  std::vector<size_t> offset;  // [R], into the buffer

  static Segments packed(std::vector<size_t> bytes);  // offsets = exclusive prefix sums
  size_t total() const;
};

// One buffer of a (multi-buffer) all-to-all-v.
struct AllToAllBuffer {
  const void* send = nullptr;
  const Segments* send_segs = nullptr;
  void* recv = nullptr;
  const Segments* recv_segs = nullptr;
};

// Throws moe::Error unless b's send and receive segment lists have one entry per
// rank of a group of `ranks`.
void check_segments(const AllToAllBuffer& b, int ranks);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // "inproc", "ucx"

  // All-to-all-v of bytes, for several buffers at once (one round of messages):
  // segment r of each send goes to rank r, and rank r's segment for us lands at
  // recv + recv_segs.offset[r]. recv_segs.bytes must match what the peers send (use
  // exchange_counts first). The self segment is copied locally.
  virtual void all_to_all_v(const std::vector<AllToAllBuffer>& buffers, Deadline deadline) = 0;

  void all_to_all_v(const void* send, const Segments& send_segs, void* recv, const Segments& recv_segs,
                    Deadline deadline) {
    all_to_all_v({AllToAllBuffer{send, &send_segs, recv, &recv_segs}}, deadline);
  }

  // recv[r] = the send[rank()] value of rank r: counts before an all-to-all-v.
  virtual void exchange_counts(const int64_t* send, int64_t* recv, Deadline deadline);

  // data <- sum over ranks, added in rank order 0..R-1, so every rank gets the same
  // bits.
  virtual void all_reduce_sum(float* data, size_t count, Deadline deadline) = 0;

  virtual void barrier(Deadline deadline) = 0;

  // Point-to-point. A message matches on (source, tag); tags < 2^32.
  virtual void send(int peer, const void* data, size_t bytes, uint32_t tag, Deadline deadline) = 0;
  virtual void recv(int peer, void* data, size_t bytes, uint32_t tag, Deadline deadline) = 0;

  // Background point-to-point (expert copies while steps go on): posted now,
  // moved while the rank makes its other transport calls, or when test()
  // progresses it. Its tags are apart from send/recv's. The buffer must stay
  // valid until test() returns true or the communicator is destroyed: `keep`
  // (the buffer's owner, optional) is held until then, so a caller may drop a
  // transfer it no longer wants.
  using TransferId = uint64_t;
  virtual TransferId isend(int peer, const void* data, size_t bytes, uint32_t tag,
                           std::shared_ptr<const void> keep = {}) = 0;
  virtual TransferId irecv(int peer, void* data, size_t bytes, uint32_t tag, std::shared_ptr<const void> keep = {}) = 0;
  // Progresses; true once the transfer completed (the id is then forgotten).
  // Throws TransportError naming the peer when it failed, like any wait.
  virtual bool test(TransferId id) = 0;

  // Told from outside that the group failed (the agent saw a node die or
  // restart, or halted an elastic job's world): a wait in progress on another
  // thread, and every later call, fails with `why`. Thread-safe. In-process,
  // UCX and NCCL communicators end their waits.
  virtual void abort(const std::string& why) { (void)why; }
};

}  // namespace moe::transport
