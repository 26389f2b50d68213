// TransferWorker: runs a rank's communicator calls on a thread of their own, in
// the order they were posted, so the rank's compute threads keep computing while
// a transfer is in flight (docs/layer.md#overlap). The pre-process (packing a
// send buffer) and post-process (unpacking) stay with the caller; only the
// transfer runs here.
//
// Contract: while an op is posted and not yet waited for, the caller makes no
// call on the communicators the op uses (ops of one rank are collectives in the
// same order on every rank, so they may not interleave with the caller's).
// A failed op fails every later op of the same worker with the same error, and
// every wait, until drain().
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace moe::transport {

class TransferWorker {
 public:
  using OpId = uint64_t;

  TransferWorker();
  ~TransferWorker();  // waits for posted ops (each has its own deadline), then joins
  TransferWorker(const TransferWorker&) = delete;
  TransferWorker& operator=(const TransferWorker&) = delete;

  // Queues op; returns its id (ids rise by one from 1).
  OpId post(std::function<void()> op);
  // Blocks until op `id` and every op before it ran; rethrows the worker's
  // error if one failed.
  void wait(OpId id);
  // Waits for everything posted and forgets the error: after a failure, and
  // when unwinding (the buffers the ops use must outlive them).
  void drain() noexcept;

 private:
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  OpId posted_ = 0, done_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the state above exists
};

}  // namespace moe::transport
