// Runs one job on a daemon's local ranks: a thread per rank (RankRun), each with
// its pool, backend (from the daemon's factory), communicator (UCX to other
// daemons, in-process to its siblings through a LocalHub, bootstrapped through
// the agent) and model stack. Step reports and, at the end, each rank's done
// (with verify errors) or the error that stopped it reach the agent through the
// job's ReportSender, which holds them while the agent is away.
#pragma once

#include <atomic>
#include <map>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "moe/kernels/api.h"
#include "moe/kernels/thread_pool.h"
#include "moe/metrics/daemon_metrics.h"
#include "moe/node/agent_link.h"
#include "moe/node/rebalance_session.h"
#include "moe/node/report_sender.h"
#include "moe/node/serving_node.h"
#include "moe/node/world_mailbox.h"
#include "moe/transport/local_hub.h"
#include "moe/v1/job_run.pb.h"

namespace moe::node {

// Makes one rank's backend on the rank's pool (the pool outlives it) and on the
// node's device `device` (the rank's local index: its GPU for the CUDA backend).
using BackendFactory = std::function<std::unique_ptr<kernels::Backend>(kernels::ThreadPool& pool, int device)>;

struct RunnerEnv {
  std::string agent_address;
  std::string token;
  rpc::TlsFiles tls;
  std::string node_name;
  int node_index = 0;
  int devices = 1;
  int threads_per_rank = 1;
  BackendFactory make_backend;
  metrics::DaemonMetrics* metrics = nullptr;  // may be null
  std::chrono::milliseconds transport_timeout{30000};
  std::chrono::milliseconds stop_grace{5000};  // DaemonOptions::stop_grace
  FaultInjection faults;  // test hooks (MOE_FAULT_INJECT)
  AgentLink* link = nullptr;       // the daemon's; outlives the job
  ReportSender* reports = nullptr;  // the job's, set by JobRunner
};

class JobRunner {
 public:
  JobRunner(v1::StartJob job, RunnerEnv env);
  // Cancels; ranks that reach no step boundary within env.stop_grace (a peer gone
  // silent mid-transfer) have their transports aborted; then waits for them.
  ~JobRunner();
  const std::string& job_id() const { return job_.job_id(); }
  bool finished() const { return running_.load() == 0; }
  void cancel(const std::string& reason);
  // The job failed (the agent says why, e.g. a node died): cancel, and the ranks'
  // device transports abort at once, so no rank waits out a deadline on NCCL.
  void fail(const std::string& reason);
  // The agent stayed unreachable past the daemon's grace: stop at the next step
  // boundary, the ranks' RankDones saying so.
  void stop_for_agent(const std::string& reason);
  // The agent recorded the job's end (until then a re-registration names it).
  bool settled() const { return reports_->settled(); }
  // Where the agent's PREPARE / COMMIT / ABORT go (docs/placement.md#live-rebalance).
  RebalanceMailbox& rebalance_mailbox() { return mailbox_; }

  // Elastic jobs (docs/jobs.md#elastic-jobs). halt(): the agent stops world
  // `epoch`: the ranks' transports of that world abort, and each rank reports
  // what it applied. new_world(): the world the ranks move to (throws
  // rpc::RpcError naming an epoch that is not newer, or ranks of other nodes).
  void halt(int64_t epoch, const std::string& reason);
  void new_world(const v1::NewWorld& next);
  // Where the ranks wait for the next world and find each world's hub.
  WorldMailbox& worlds() { return worlds_; }
  // A serving job's calls on this node (docs/serving.md); null for other jobs.
  ServingNode* serving() { return serve_.get(); }
  const v1::JobSpec& spec() const { return job_.spec(); }
  // This node's first rank in the job's first world here (a joining node's
  // place in the world it joins).
  int first_rank() const;

 private:
  void rank_main(int local);
  std::string cancel_reason() const;

  v1::StartJob job_;
  RunnerEnv env_;
  RebalanceMailbox mailbox_;
  WorldMailbox worlds_;
  std::unique_ptr<ServingNode> serve_;  // mode serve only
  std::unique_ptr<ReportSender> reports_;
  std::atomic<bool> cancel_{false};
  std::atomic<bool> agent_lost_{false};
  mutable std::mutex cancel_mu_;
  std::string cancel_reason_;  // guarded by cancel_mu_
  std::string failure_;        // fail()'s reason, guarded by cancel_mu_
  std::map<int, class RankRun*> live_ranks_;  // constructed RankRuns by local index, guarded by cancel_mu_
  std::string stop_abort_;  // set when the stop grace ran out: ranks abort (guarded by cancel_mu_)
  std::atomic<int> running_{0};
  std::vector<std::thread> threads_;
};

}  // namespace moe::node
