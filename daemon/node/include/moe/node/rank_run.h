// One rank of one job: its pool, backend, and the world it runs on (communicators,
// model stack, rebalance session), and the step loop. Cancellation and live
// rebalances are agreed on at step boundaries (one all-reduce of the cancel flag
// and the rebalance votes), so every rank stops, stages or switches before the
// same step. Every step is reported to the agent; the covered step
// (docs/jobs.md#verify) is verified and dumped when asked.
//
// An elastic job (docs/jobs.md#elastic-jobs) outlives its world: when a peer
// fails or the agent halts the world, the rank keeps its state, tells the agent
// what it applied (RankHalted), and when the agent's NewWorld comes it catches
// up to the resume step, builds the new world's transports and stack, and moves
// the expert states the new placement asks for from the old stack.
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include "moe/node/agent_bootstrap.h"
#include "moe/node/job_runner.h"
#include "moe/node/model_stack.h"
#include "moe/node/rebalance_session.h"
#include "moe/node/step_report.h"
#include "moe/node/world_change.h"
#include "moe/rpc/client.h"
#include "moe/transport/transport_factory.h"

namespace moe::node {

struct RankWorld;
struct RankWorldEnv;

class RankRun {
 public:
  // rank: in job's world (job.join's for a joining node, whose ranks then take
  // their state from the others before the first step).
  RankRun(const v1::StartJob& job, const RunnerEnv& env, int rank, int local, JobRunner& runner, rpc::RpcClient& agent);
  ~RankRun();

  // Runs the steps (from the checkpoint's step when resuming) until done or a
  // cancel agreed by every rank, writing checkpoints when due; an elastic job
  // moves to each new world the agent sends. Returns the number of steps
  // completed (counted from step 0).
  int run(const std::function<bool()>& cancel_requested);
  // The job failed elsewhere, or (elastic) the agent halts world `epoch` (-1:
  // whichever): a wait on this rank's transports fails now with `why` instead of
  // at its deadline. Thread-safe.
  void abort_transport(const std::string& why, int64_t epoch = -1);
  const v1::Verify& verification() const { return verify_; }
  // The world this rank was last told to be in, and its rank there (rank thread).
  int rank() const;
  int64_t world_epoch() const;

 private:
  using World = RankWorld;
  RankWorldEnv world_env();
  transport::Deadline deadline() const { return transport::deadline_in(env_.transport_timeout); }
  // The steps of the current world, until done or cancelled.
  int run_world(const std::function<bool()>& cancel_requested);
  // The step's own collective: one all-reduce carries the cancel flag and every
  // rank's rebalance vote, so every rank acts before the same step. True: stop.
  bool agree_and_act(bool cancel_requested, int step);
  void run_step(int step);
  std::string nonfinite(const StepReport& report) const;
  void agree(int step, const std::string& nonfinite_here, StepReport& report);
  void finish_step(int step, StepReport& report);
  void send_report(const StepReport& report);
  void send_stats(const v1::StepStats& stats);
  bool checkpoint_due(int steps_done) const;
  // Elastic: the world failed; tell the agent what this rank applied.
  void report_halted(const std::string& why, int failed_peer);
  // Elastic: catch up (or back) to the new world's resume step, then move onto it.
  void enter(const v1::NewWorld& next);
  void catch_up(int resume_step);
  // The new world's side of a state move (world_change.h), and the stacks this
  // rank holds: `from` (the world it leaves; null for none), then the retired ones.
  WorldTarget target(World& w) const;
  std::vector<HeldStack> held(World* from) const;

  const v1::StartJob& job_;
  const RunnerEnv& env_;
  const int local_;  // the rank's device on this node
  JobRunner& runner_;
  rpc::RpcClient& agent_;
  kernels::ThreadPool pool_;
  std::unique_ptr<kernels::Backend> backend_;
  mutable std::mutex world_mu_;  // world_ and entering_, against abort_transport
  std::unique_ptr<World> world_;
  World* entering_ = nullptr;  // the world enter() is moving the state to
  // Stacks of worlds this rank left, until the current world completes a step
  // (a halt before then may need the experts only they hold). Rank thread only.
  std::vector<std::unique_ptr<World>> retired_;
  struct Place {
    int64_t epoch = 0;
    int rank = 0;
  } place_;
  v1::Verify verify_;
  int first_step_ = 0;        // a resumed run's first step
  int world_first_step_ = 0;  // the current world's
  // What this rank applied, for RankHalted: steps whose optimizer (train) or bias
  // update (forward) ran, and whether it holds the next one's reduced gradients.
  int applied_ = 0;
  bool pending_ = false;
  std::optional<StepReport> pending_report_;  // that step's report, sent once applied
};

}  // namespace moe::node
