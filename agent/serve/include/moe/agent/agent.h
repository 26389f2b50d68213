// moe-agent, the coordinator (docs/architecture.md#processes, docs/control-plane.md,
// docs/placement.md): serves daemons and moectl over the framed RPC and wires the
// agent's rooms together:
//   Membership       registration, heartbeats, ranks, busy nodes
//   BootstrapRelay   the running job's transport bootstrap bytes
//   Scheduler        the queue and the job state machine (results via job_result)
//   PlacementService the per-layer expert maps, their epochs and load windows
//   Rebalancer       live rebalancing of a running job (PREPARE/READY/COMMIT/ABORT)
//   Outbound         blocking calls to daemons, off the io thread
//   StateStore       the state directory a restarted agent reads back
// All state lives on one io_context thread; outbound results are posted back.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "moe/rebalance/auto_rebalance.h"
#include "moe/cluster/bootstrap_relay.h"
#include "moe/cluster/membership.h"
#include "moe/cluster/placement_service.h"
#include "moe/rebalance/rebalancer.h"
#include "moe/jobs/scheduler.h"
#include "moe/agent/state_store.h"
#include "moe/rpc/server.h"
#include "moe/v1/rpc.pb.h"

namespace moe::agent {

struct AgentOptions {
  std::string listen = "127.0.0.1:0";
  std::string token;
  rpc::TlsFiles tls;  // empty: plain TCP (--plaintext)
  std::string name = "agent";  // the node label of the agent's scrape target
  std::string metrics_address;  // HOST:PORT of the agent's /metrics, "" when off
  std::string prometheus_sd_file;  // "" = none; else rewritten on every membership change
  std::chrono::milliseconds heartbeat_interval{250};
  std::chrono::milliseconds heartbeat_timeout{3000};
  std::chrono::milliseconds daemon_call_timeout{10000};
  // HaltWorld (elastic jobs): a node that does not answer this fast is lost.
  std::chrono::milliseconds halt_call_timeout{2000};
  // Steps of measured load per (shape, layer) (docs/placement.md#load-and-balancedness).
  int load_window = 32;
  RebalanceOptions rebalance;
  // Auto-rebalance: at most once every this many steps of a job (0: off), when the
  // window's balancedness is below the threshold and the solver predicts at
  // least 0.05 more, with this many redundant experts (unset: the shape's count).
  int rebalance_every = 0;
  double balancedness_threshold = 0.9;
  std::optional<int> redundant_experts;
  SchedulerOptions scheduler;
  // Persist membership, the bound address, the maps with their epochs and
  // windows, and the job history here, and read them back on start ("": off).
  std::string state_dir;
  // With state_dir: keep the history and maps but none of the nodes (a new
  // cluster; a job that was running fails).
  bool forget_nodes = false;
};

class Outbound;

class Agent : private SchedulerActions, private RebalanceActions {
 public:
  Agent(rpc::asio::io_context& io, AgentOptions options);
  ~Agent() override;
  std::string address() const { return server_->address(); }
  // Stops serving; pending daemon calls are abandoned.
  void stop();
  // The agent's own /metrics address, once its exposer is up (status, file_sd).
  void set_metrics_address(const std::string& address);

  // Read on the io thread (metrics).
  const Membership& membership() const { return members_; }
  const Scheduler& scheduler() const { return scheduler_; }
  const PlacementService& placement() const { return placement_; }
  const Rebalancer& rebalancer() const { return rebalancer_; }
  // The state directory's last write error; empty while writes succeed or with none.
  const std::string& state_error() const { return persist_error_; }
  bool saves_state() const { return store_ != nullptr; }

 private:
  rpc::awaitable<v1::Envelope> handle(const v1::Envelope& req, const rpc::RequestContext& ctx);
  v1::Envelope on_register(const v1::RegisterNodeRequest& r);
  rpc::awaitable<v1::Envelope> on_bootstrap(const v1::BootstrapPublish& p, const rpc::RequestContext& ctx);
  v1::Envelope on_rank_done(const v1::RankDone& d);
  v1::Envelope on_import(const v1::PlacementImport& imp);
  v1::Envelope on_placement_reset(const v1::PlacementReset& r);
  rpc::awaitable<v1::Envelope> on_rebalance(const v1::RebalanceRequest& r, const rpc::RequestContext& ctx);
  void maybe_auto_rebalance(const std::string& job_id, int step);
  rpc::awaitable<v1::Envelope> on_wait(const v1::WaitJobRequest& r, const rpc::RequestContext& ctx);
  v1::Envelope cluster_status() const;
  rpc::awaitable<void> watchdog();
  Clock::duration dead_node_timeout() const;
  void schedule_soon();
  void write_scrape_targets() const;

  // The state directory (agent_state.cc). load_state reads it back into the
  // rooms and returns what it held (throws StateFileError naming the file);
  // serve binds the address of the previous run when --listen's port is 0.
  std::optional<v1::AgentState> load_state();
  void serve(const std::optional<v1::AgentState>& saved);
  std::unique_ptr<rpc::RpcServer> listen_on(const std::string& address, const rpc::Handler& handler);
  v1::AgentState snapshot() const;
  // Writes the state now; persist_soon at most once a second (step reports).
  void persist();
  void persist_soon();
  v1::Envelope report_ack(const std::string& job_id) const;

  // SchedulerActions
  void start_job(const v1::StartJob& start) override;
  void cancel_job(const std::string& job_id, const std::string& reason, bool failed) override;
  void job_ended(const v1::JobResult& result) override;
  void step_completed(const std::string& job_id, int step) override;
  void halt_world(const std::string& job_id, int64_t epoch, const std::string& reason,
                  const std::vector<int>& nodes) override;
  void new_world(const v1::NewWorld& world, const std::vector<int>& nodes, const v1::StartJob& join,
                 const std::vector<int>& joining) override;
  void tell_world(int index, const v1::Envelope& req, const v1::NewWorld& world);
  void send_cancel(const NodeRecord& n, const std::string& job_id, const std::string& reason, bool failed);
  void fence(const std::string& job_id, int node, const std::string& reason) override;

  // RebalanceActions
  void prepare(const v1::PrepareRebalance& p) override;
  void commit(const v1::CommitRebalance& c) override;
  void send_commit(const v1::CommitRebalance& c, const std::string& node, int attempt);
  void abort(const v1::AbortRebalance& a) override;
  void rebalance_done(const v1::RebalanceReply& r) override;
  // Sends req to every live node's daemon; on_error(node, error) on the io thread.
  void to_every_node(const v1::Envelope& req, std::function<void(const std::string&, const std::string&)> on_error);

  rpc::asio::io_context& io_;
  AgentOptions opts_;
  Membership members_;
  PlacementService placement_;
  Scheduler scheduler_;
  Rebalancer rebalancer_;
  BootstrapRelay relay_;
  std::unique_ptr<rpc::RpcServer> server_;
  std::unique_ptr<Outbound> outbound_;
  rpc::AsyncEvent job_event_, bootstrap_event_, rebalance_event_;
  AutoRebalanceGate auto_gate_;
  bool stopped_ = false;
  std::unique_ptr<StateStore> store_;
  int64_t incarnation_ = 0;  // changes on every start; daemons re-send their reports when it does
  rpc::asio::steady_timer persist_timer_;
  bool persist_pending_ = false;
  Clock::time_point last_persist_{};
  std::string persist_error_;  // the last write error, logged once
  double persist_error_since_ = 0;  // unix ms of the first failed write of a run of them
};

}  // namespace moe::agent
