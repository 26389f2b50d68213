// moe-agent, the coordinator (DESIGN 1, 5, 7): serves daemons and moectl over the
// framed RPC and wires the agent's rooms together:
//   Membership       registration, heartbeats, ranks, busy nodes
//   BootstrapRelay   the running job's transport bootstrap bytes
//   Scheduler        the queue and the job state machine (results via job_result)
//   PlacementService the per-layer expert maps and their epochs
//   Outbound         blocking calls to daemons, off the io thread
// All state lives on one io_context thread; outbound results are posted back.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "moe/agent/bootstrap_relay.h"
#include "moe/agent/membership.h"
#include "moe/agent/placement_service.h"
#include "moe/agent/scheduler.h"
#include "moe/rpc/rpc.h"
#include "moe/v1/rpc.pb.h"

namespace moe::agent {

struct AgentOptions {
  std::string listen = "127.0.0.1:0";
  std::string token;
  std::string name = "agent";  // the node label of the agent's scrape target
  std::string metrics_address;  // HOST:PORT of the agent's /metrics, "" when off
  std::string prometheus_sd_file;  // "" = none; else rewritten on every membership change
  std::chrono::milliseconds heartbeat_interval{500};
  std::chrono::milliseconds heartbeat_timeout{3000};
  std::chrono::milliseconds daemon_call_timeout{10000};
  SchedulerOptions scheduler;
};

class Outbound;

class Agent : private SchedulerActions {
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

 private:
  rpc::awaitable<v1::Envelope> handle(const v1::Envelope& req, const rpc::RequestContext& ctx);
  v1::Envelope on_register(const v1::RegisterNodeRequest& r);
  rpc::awaitable<v1::Envelope> on_bootstrap(const v1::BootstrapPublish& p, const rpc::RequestContext& ctx);
  v1::Envelope on_rank_done(const v1::RankDone& d);
  rpc::awaitable<v1::Envelope> on_wait(const v1::WaitJobRequest& r, const rpc::RequestContext& ctx);
  v1::Envelope cluster_status() const;
  rpc::awaitable<void> watchdog();
  void schedule_soon();
  void write_scrape_targets() const;

  // SchedulerActions
  void start_job(const v1::StartJob& start) override;
  void cancel_job(const std::string& job_id, const std::string& reason) override;
  void job_ended(const v1::JobResult& result) override;

  rpc::asio::io_context& io_;
  AgentOptions opts_;
  Membership members_;
  PlacementService placement_;
  Scheduler scheduler_;
  BootstrapRelay relay_;
  std::unique_ptr<rpc::RpcServer> server_;
  std::unique_ptr<Outbound> outbound_;
  rpc::AsyncEvent job_event_, bootstrap_event_;
  bool stopped_ = false;
};

}  // namespace moe::agent
