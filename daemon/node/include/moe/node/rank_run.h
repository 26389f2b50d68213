// One rank of one job: its pool, backend, communicators and model stack, and the
// step loop. Cancellation is agreed on at step boundaries (an all-reduce of the
// flag), so every rank stops before the same step. Every step is reported to the
// agent; the step DESIGN 6 names (step 0) is verified and dumped when asked.
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include "moe/node/job_runner.h"
#include "moe/node/model_stack.h"
#include "moe/rpc/rpc.h"
#include "moe/transport/ucx_communicator.h"

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
  // What every rank decided together at a step boundary.
  struct Boundary {
    bool stop = false;    // cancel
    bool stage = false;   // every rank holds the same PREPARE: start staging
    bool abort = false;   // some rank got ABORT for the staged epoch
    bool commit = false;  // every rank got COMMIT for the staged epoch: switch
    std::optional<v1::PrepareRebalance> prepare;  // what this rank contributed (stage)
  };
  transport::Deadline deadline() const { return transport::deadline_in(env_.transport_timeout); }
  // The step's own collective: one all-reduce carries the cancel flag and the
  // rebalance state, so every rank acts before the same step.
  Boundary agree(bool cancel_requested);
  void act(const Boundary& b, int step);
  void check_staged();
  void tell_agent_ready(bool ok, const std::string& reason);
  void run_step(int step);
  bool checkpoint_due(int steps_done) const;

  const v1::StartJob& job_;
  const v1::JobSpec& spec_;
  const RunnerEnv& env_;
  const int rank_;
  const int local_;  // the rank's device on this node
  kernels::ThreadPool pool_;
  std::unique_ptr<kernels::Backend> backend_;
  AgentBootstrap boot_;
  transport::RootBlobBootstrap root_boot_;  // carries a CUDA job's NCCL id beside the UCX addresses
  transport::UcxCommunicator comm_;         // host memory: control, counts, copies
  std::unique_ptr<transport::Communicator> data_comm_;  // the backend's memory (NCCL); null: comm_
  rpc::RpcClient& agent_;
  ModelStack stack_;
  RebalanceMailbox& mailbox_;
  std::optional<v1::PrepareRebalance> staged_;  // the epoch being staged
  bool staged_ready_ = false;
  v1::Verify verify_;
  int first_step_ = 0;  // a resumed run's first step
};

}  // namespace moe::node
