// moe-agent, the coordinator: membership (register, heartbeats, dead-node
// detection), global rank assignment, the transport bootstrap relay, the job queue
// (one job at a time on every rank), per-step statistics, job records, and the
// placement map. All state lives on one io_context thread; calls to daemons run
// on an outbound thread and post their results back.
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "moe/v1/rpc.pb.h"
#include "moe/rpc/rpc.h"

namespace moe::agent {

struct AgentOptions {
  std::string listen = "127.0.0.1:0";
  std::string token;
  std::chrono::milliseconds heartbeat_interval{500};
  std::chrono::milliseconds heartbeat_timeout{3000};
  std::chrono::milliseconds daemon_call_timeout{10000};
  // After a job failed, how long the agent waits for every rank to report before
  // it records the failure anyway (ranks blocked in a transport wait run into its
  // deadline first).
  std::chrono::milliseconds failed_job_grace{45000};
  // A running job from which no rank reported anything (bootstrap, step, done)
  // for this long is failed: a lost report must not hold the queue forever.
  std::chrono::milliseconds stale_job_timeout{30 * 60 * 1000};
};

class Outbound;

class Agent {
 public:
  Agent(rpc::asio::io_context& io, AgentOptions options);
  ~Agent();
  std::string address() const { return server_->address(); }
  // Stops serving; pending daemon calls are abandoned.
  void stop();

  // For the metrics exposer: counts by state (read on the io thread).
  std::map<v1::NodeState, int> node_counts() const;
  std::map<v1::JobState, int> job_counts() const;
  int64_t placement_epoch() const { return placement_epoch_; }
  const std::vector<v1::PlacementMap>& maps() const { return maps_; }
  // Per layer, tokens per logical expert of the last job that finished (empty before).
  const std::vector<std::vector<double>>& last_expert_loads() const { return last_loads_; }

 private:
  struct Node {
    std::string name;
    int index = 0;
    v1::NodeState state = v1::NODE_STATE_ALIVE;
    int devices = 0;
    std::string control_address, metrics_address;
    std::chrono::steady_clock::time_point last_heartbeat;
    // The job whose ranks on this node have not all reported done yet: the daemon
    // is still busy with it even if the agent already recorded its end.
    std::string busy_job;
    int busy_ranks = 0;
  };
  struct Running {
    std::string id;
    v1::JobSpec spec;
    int world = 0;
    std::vector<std::string> blobs;
    std::vector<bool> published;
    int published_count = 0;
    std::vector<bool> done;
    int done_count = 0;
    bool failed = false, cancelled = false;
    bool reason_known = false;  // the cancel's message names its cause
    std::string message;
    std::map<int, std::vector<v1::StepStats>> steps;  // step -> by rank
    std::vector<v1::Verify> verify;
    std::chrono::steady_clock::time_point failed_at, last_report;
  };

  rpc::awaitable<v1::Envelope> handle(const v1::Envelope& req, const rpc::RequestContext& ctx);
  v1::Envelope on_register(const v1::RegisterNodeRequest& r);
  v1::Envelope on_heartbeat(const v1::HeartbeatRequest& r);
  rpc::awaitable<v1::Envelope> on_bootstrap(const v1::BootstrapPublish& p, const rpc::RequestContext& ctx);
  v1::Envelope on_step(const v1::StepReport& r);
  v1::Envelope on_rank_done(const v1::RankDone& d);
  v1::Envelope on_submit(const v1::SubmitJobRequest& r);
  rpc::awaitable<v1::Envelope> on_wait(const v1::WaitJobRequest& r, const rpc::RequestContext& ctx);
  v1::Envelope on_cancel(const v1::CancelJobRequest& r);
  v1::Envelope cluster_status() const;

  v1::JobResult& record(const std::string& job_id);  // throws NOT_FOUND
  rpc::awaitable<void> watchdog();
  void try_schedule();
  void start(const std::string& job_id);
  // Fails a job that could not start and moves on to the next one.
  void fail_unstarted(v1::JobResult& rec, const std::string& message);
  // Ends the running job: builds its result from the step reports.
  void finish(v1::JobState state, const std::string& message);
  void fail_running(const std::string& message);  // fails the job and tells the daemons to stop
  void cancel_daemons(const std::string& reason);
  std::string describe_rank(int rank) const;  // "rank 3 (node node1)"
  int world_size() const;

  rpc::asio::io_context& io_;
  AgentOptions opts_;
  std::unique_ptr<rpc::RpcServer> server_;
  std::unique_ptr<Outbound> outbound_;
  rpc::AsyncEvent job_event_, bootstrap_event_;
  bool stopped_ = false;

  std::vector<Node> nodes_;  // by node index
  int devices_per_node_ = 0;
  std::map<std::string, v1::JobResult> jobs_;
  std::deque<std::string> queue_;
  int64_t next_job_ = 1;
  std::unique_ptr<Running> running_;
  std::vector<v1::PlacementMap> maps_;
  std::vector<std::vector<double>> last_loads_;
  int64_t placement_epoch_ = 0;
};

}  // namespace moe::agent
