// A serving job's calls on one node (docs/serving.md): the daemon's RPC thread
// queues each call of a layer; the node's ranks take rows of the layer every rank
// agreed on for a serve step, compute them, and hand the results back; a call
// completes when all of its rows are back, whichever ranks computed them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "moe/layer_spec/job_layers.h"
#include "moe/v1/serve.pb.h"

namespace moe::node {

using ServeClock = std::chrono::steady_clock;

// What a call asks of its layer: the output of x, or (a training job) the
// input's gradient for grad_y at x, by recomputing the forward.
enum class ServeKind : int { kForward = 0, kBackward = 1 };
constexpr int kServeKinds = 2;

// One client call: rows x [rows, row_bytes] of `layer` (and grad_y, backward);
// y (the output, or the input's gradient) is filled as ranks finish its pieces.
// done() runs once, on the thread that completes it (the last piece, or a
// failure).
struct ServeCall {
  ServeKind kind = ServeKind::kForward;
  int layer = 0;
  int64_t rows = 0;
  size_t row_bytes = 0;
  std::vector<uint8_t> x, grad_y;
  std::string y;  // the reply's bytes: moved into it
  std::string caller;  // the connection it came on (its peer), for the batching rule
  // The queue a call waits in: one per layer and kind.
  int lane() const { return layer * kServeKinds + static_cast<int>(kind); }
  ServeClock::time_point queued;
  std::function<void(const std::string& error)> done;  // "" on success
  // The queue's bookkeeping (guarded by its mutex): rows handed out, rows back,
  // whether done() ran, and pieces handed out that came back uncomputed (their
  // world failed), to hand out again first.
  int64_t handed = 0, back = 0;
  bool over = false;
  std::vector<std::pair<int64_t, int64_t>> returned;  // [first, n)
  int64_t rows_to_hand() const;
};

// A client's call checked against the job: the layer exists, the hidden size and
// dtype are the job's, the rows fit (at most `max_rows`), x has their bytes and
// every value is finite. Throws moe::InvalidArgument naming the field (and the
// rows holding a non-finite value). done is the caller's to set.
std::shared_ptr<ServeCall> make_serve_call(const layer_spec::JobView& job, const v1::ServeForward& call,
                                           int64_t max_rows);
// A backward call checked likewise (grad_y for x); x: the rows its handle kept
// for the layer.
std::shared_ptr<ServeCall> make_serve_call(const layer_spec::JobView& job, const v1::ServeBackward& call,
                                           std::vector<uint8_t> x, int kept_layer);

// Rows [first, first + n) of a call, taken by one rank for one step.
struct ServePiece {
  std::shared_ptr<ServeCall> call;
  int64_t first = 0, n = 0;
};

class ServeQueue {
 public:
  explicit ServeQueue(int layers) : waiting_(static_cast<size_t>(layers) * kServeKinds) {}
  int lanes() const { return static_cast<int>(waiting_.size()); }

  // The RPC thread: queues a call (checked by the caller) unless the queue closed
  // or `max_rows` rows would then wait; returns "" when queued, else why not
  // (done() is not run: the caller answers).
  std::string push(std::shared_ptr<ServeCall> call, int64_t max_rows);
  // The caller stopped waiting (its deadline passed): the rows not handed out
  // leave the queue, and pieces in flight are dropped when they come back.
  void abandon(const std::shared_ptr<ServeCall>& call);
  // A rank before a serve step: returns once `rows` rows wait, every caller
  // seen in the last kRecentCaller has a call waiting (docs/serving.md#batching;
  // with max_wait 0, any call), or max_wait (at least 1 ms) passed; false when
  // the queue closed.
  bool wait_for_step(int64_t rows, std::chrono::milliseconds max_wait);
  static constexpr std::chrono::milliseconds kRecentCaller{250};
  // Per lane (ServeCall::lane), how long the oldest queued row has waited (ms;
  // 0: none), the rank's part of the step vote.
  std::vector<float> ages(ServeClock::time_point now) const;
  // Rows waiting, over the lanes.
  int64_t queued() const;
  // Up to max_rows rows of `lane` from the oldest calls on.
  std::vector<ServePiece> take(int lane, int64_t max_rows);
  // A piece's results (n rows of row_bytes): the call completes with its last piece.
  void finish(const ServePiece& piece, const uint8_t* y);
  // A piece that could not be computed: its call fails with `why` (once).
  void fail(const ServePiece& piece, const std::string& why);
  // Pieces whose step's world failed (an elastic job moves to a new world,
  // docs/serving.md#elastic-serving): their rows wait again, in their calls'
  // order, for the next rank that takes the lane.
  void put_back(const std::vector<ServePiece>& pieces);
  // The job ends: every queued call fails with `why`, and later pushes too.
  void close(const std::string& why);

 private:
  // Marks the call over; the caller runs done() after unlocking.
  static bool end(ServeCall& call);
  int64_t queued_rows() const;   // under mu_
  int64_t queued_calls() const;  // under mu_: calls with rows not handed out
  int64_t recent_callers(ServeClock::time_point now);  // under mu_, forgetting older ones

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::deque<std::shared_ptr<ServeCall>>> waiting_;  // by lane, oldest first, rows left to hand out
  std::string closed_;                                          // why, once closed
  std::map<std::string, ServeClock::time_point> callers_;       // when each caller last pushed
};

}  // namespace moe::node
