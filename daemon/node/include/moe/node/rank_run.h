// One rank of one job: its pool, backend, communicators and model stack, and the
// step loop. Cancellation and live rebalances are agreed on at step boundaries
// (one all-reduce of the cancel flag and the rebalance votes), so every rank stops,
// stages or switches before the same step. Every step is reported to the
// agent; the covered step (docs/jobs.md#verify) is verified and dumped when asked.
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include "moe/node/job_runner.h"
#include "moe/node/model_stack.h"
#include "moe/node/rebalance_session.h"
#include "moe/rpc/client.h"
#include "moe/transport/transport_factory.h"

namespace moe::node {

// The transport bootstrap through the agent: publish our bytes, get everyone's.
class AgentBootstrap final : public transport::Bootstrap {
 public:
  AgentBootstrap(rpc::RpcClient& agent, std::string job_id, int rank)
      : agent_(agent), job_id_(std::move(job_id)), rank_(rank) {}
  std::vector<std::string> all_gather(const std::string& mine) override;

 private:
  rpc::RpcClient& agent_;
  std::string job_id_;
  int rank_;
};

class RankRun {
 public:
  RankRun(const v1::StartJob& job, const RunnerEnv& env, int rank, std::shared_ptr<transport::LocalHub> hub,
          rpc::RpcClient& agent, RebalanceMailbox& mailbox);

  // Runs the steps (from the checkpoint's step when resuming) until done or a
  // cancel agreed by every rank, writing checkpoints when due; returns the number
  // of steps completed (counted from step 0).
  int run(const std::function<bool()>& cancel_requested);
  // The job failed elsewhere (the agent said so): a wait on the device transport
  // fails now with `why` instead of at its deadline. Thread-safe.
  void abort_transport(const std::string& why);
  const v1::Verify& verification() const { return verify_; }

 private:
  transport::Deadline deadline() const { return transport::deadline_in(env_.transport_timeout); }
  // The step's own collective: one all-reduce carries the cancel flag and every
  // rank's rebalance vote, so every rank acts before the same step. True: stop.
  bool agree_and_act(bool cancel_requested, int step);
  void run_step(int step);
  std::string nonfinite(const StepReport& report) const;
  void agree_finite(int step, const std::string& what);
  bool checkpoint_due(int steps_done) const;

  const v1::StartJob& job_;
  const v1::JobSpec& spec_;
  const RunnerEnv& env_;
  const int rank_;
  const int local_;  // the rank's device on this node
  kernels::ThreadPool pool_;
  std::unique_ptr<kernels::Backend> backend_;
  AgentBootstrap boot_;
  transport::RankTransports transports_;  // host, and the backend's memory (null: host)
  transport::Communicator& comm_;         // transports_.host: control, counts, copies
  ModelStack stack_;
  RebalanceSession rebalance_;
  v1::Verify verify_;
  int first_step_ = 0;  // a resumed run's first step
};

}  // namespace moe::node
