// A serving job's requests that are not rows (docs/serving.md#training), on one
// node: optimizer steps, applied once when `clients` callers asked for the
// step, and weight reads. The RPC thread adds them; the node's first rank
// counts them into the serve step's vote, and after the ranks ran the step or
// the read together, answers them. Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "moe/v1/serve.pb.h"

namespace moe::node {

class ServeRequests {
 public:
  // error "" on success; steps: the job's optimizer steps now; applied_now:
  // this step was applied for this request's round (false: before it).
  using StepDone = std::function<void(const std::string& error, int64_t steps, bool applied_now)>;
  using WeightsDone = std::function<void(const std::string& error, const v1::ServeWeightsReply& reply)>;

  // RPC thread. A step already applied is answered at once; the one after the
  // next waits until this node's ranks ran the next (its callers may have been
  // answered by another node first, whose ranks finished sooner); one beyond,
  // or clients other than the step's waiting callers said, throws
  // moe::InvalidArgument; after close(), the reason. A caller that asks again
  // (a retry) counts once: its earlier ask is answered "asked again".
  void ask_step(int64_t step, int clients, const std::string& caller, StepDone done);
  void ask_weights(WeightsDone done);

  // The vote: [callers of the next step, their clients (0: none wait), 1 if any
  // wait, weight reads waiting]. Summed over the nodes' first ranks.
  static constexpr int kVoteFloats = 4;
  void vote(float* v) const;
  // From the summed vote: every caller of the next step asked, over the nodes.
  static bool step_due(const float* sum);
  static bool weights_due(const float* sum) { return sum[3] > 0; }
  // After the ranks ran the next step (error "": applied; else why not): its
  // callers are answered, and the count moves on when it applied; the asks that
  // waited for it are taken as if they came now.
  void step_done(const std::string& error);
  // After the ranks read the weights: the reads counted are answered.
  void weights_read(const std::string& error, const v1::ServeWeightsReply& reply);
  int64_t steps() const;
  // A job resumed from a checkpoint: `steps` were applied (before any request).
  void resume_at(int64_t steps);
  // The job ends: every waiting request fails with `why`, and later ones.
  void close(const std::string& why);

 private:
  struct StepCall {
    int64_t step;
    int clients;
    std::string caller;
    StepDone done;
  };
  mutable std::mutex mu_;
  int64_t steps_ = 0;  // applied
  std::vector<StepCall> step_calls_;
  std::vector<StepCall> early_calls_;  // asks for the step after the next
  std::vector<WeightsDone> weight_calls_;
  std::string closed_;
};

}  // namespace moe::node
