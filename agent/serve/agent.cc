#include "moe/agent/agent.h"

#include <algorithm>
#include <filesystem>
#include <optional>

#include "moe/agent/live_load.h"
#include "moe/agent/scrape_targets.h"
#include "moe/base/check.h"
#include "moe/base/file.h"
#include "moe/base/log.h"
#include "outbound.h"

namespace moe::agent {
namespace {

// How often a state directory that refused a write is tried again.
constexpr auto kStateRetryInterval = std::chrono::seconds(2);

}  // namespace

using rpc::RpcError;

Agent::Agent(rpc::asio::io_context& io, AgentOptions options)
    : io_(io),
      opts_(std::move(options)),
      members_(opts_.heartbeat_timeout),
      placement_(opts_.load_window),
      scheduler_(opts_.scheduler, members_, placement_, *this),
      rebalancer_(opts_.rebalance, placement_, scheduler_, members_, *this),
      outbound_(std::make_unique<Outbound>(opts_.token, opts_.tls)),
      job_event_(io),
      bootstrap_event_(io),
      rebalance_event_(io),
      auto_gate_({.every = opts_.rebalance_every, .threshold = opts_.balancedness_threshold}),
      persist_timer_(io) {
  serve(load_state());
  rpc::asio::co_spawn(io_, watchdog(), rpc::asio::detached);
  write_scrape_targets();
  persist();
  log::info("listening on ", server_->address(), opts_.token.empty() ? " (no token)" : "");
}

Agent::~Agent() { stop(); }

void Agent::stop() {
  if (stopped_) return;
  persist();
  stopped_ = true;
  persist_timer_.cancel();
  server_->stop();
  outbound_.reset();  // joins: no task touches the agent after this
}

void Agent::set_metrics_address(const std::string& address) {
  opts_.metrics_address = address;
  write_scrape_targets();
}

void Agent::schedule_soon() {
  rpc::asio::post(io_, [this] {
    if (!stopped_) scheduler_.try_start(Clock::now());
  });
}

rpc::awaitable<v1::Envelope> Agent::handle(const v1::Envelope& req, const rpc::RequestContext& ctx) {
  using E = v1::Envelope;
  E reply;
  switch (req.payload_case()) {
    case E::kRegisterNode:
      co_return on_register(req.register_node());
    case E::kHeartbeat:
      reply.mutable_heartbeat_reply()->set_known(members_.heartbeat(req.heartbeat(), Clock::now()));
      reply.mutable_heartbeat_reply()->set_agent_incarnation(incarnation_);
      co_return reply;
    case E::kBootstrapPublish:
      co_return co_await on_bootstrap(req.bootstrap_publish(), ctx);
    case E::kStepReport:
      scheduler_.on_step(req.step_report(), Clock::now());
      persist_soon();
      co_return report_ack(req.step_report().job_id());
    case E::kRankDone:
      co_return on_rank_done(req.rank_done());
    case E::kRankHalted:
      scheduler_.on_rank_halted(req.rank_halted(), Clock::now());
      persist_soon();
      co_return report_ack(req.rank_halted().job_id());
    case E::kSubmitJob:
      *reply.mutable_job() = scheduler_.submit(req.submit_job().spec());
      persist();
      schedule_soon();
      co_return reply;
    case E::kGetJob:
      *reply.mutable_job() = scheduler_.view(req.get_job().job_id());
      co_return reply;
    case E::kWaitJob:
      co_return co_await on_wait(req.wait_job(), ctx);
    case E::kListJobs: {
      auto* list = reply.mutable_list_jobs_reply();  // an empty list is a valid answer
      for (v1::JobResult& job : scheduler_.list()) *list->add_jobs() = std::move(job);
      co_return reply;
    }
    case E::kCancelJobRequest:
      scheduler_.cancel(req.cancel_job_request().job_id(), Clock::now());
      *reply.mutable_job() = scheduler_.view(req.cancel_job_request().job_id());
      co_return reply;
    case E::kClusterStatus:
      co_return cluster_status();
    case E::kPlacement: {
      const v1::PlacementRequest& p = req.placement();
      // No map before the first job: an empty reply is the answer.
      *reply.mutable_placement_reply() =
          placement_.describe(ShapeKey::of(p.shape()), p.has_layer() ? std::optional<int>(p.layer()) : std::nullopt);
      co_return reply;
    }
    case E::kPlacementImport:
      co_return on_import(req.placement_import());
    case E::kPlacementReset:
      co_return on_placement_reset(req.placement_reset());
    case E::kRebalance:
      co_return co_await on_rebalance(req.rebalance(), ctx);
    case E::kRebalanceReady:
      rebalancer_.on_ready(req.rebalance_ready(), Clock::now());
      reply.mutable_ack();
      co_return reply;
    case E::kPlacementLoads:
      *reply.mutable_placement_loads_reply() = placement_.loads(ShapeKey::of(req.placement_loads().shape()));
      co_return reply;
    case E::kLiveLoad:  // moectl top; before any job a reply with no job and no layers
      *reply.mutable_live_load_reply() = live_load(members_, scheduler_, placement_, opts_.load_window);
      co_return reply;
    default:
      throw InvalidArgument("moe-agent does not serve " + rpc::payload_name(req));
  }
}

v1::Envelope Agent::on_register(const v1::RegisterNodeRequest& r) {
  const NodeRecord& n = members_.register_node(r, scheduler_.running() != nullptr, Clock::now());
  scheduler_.on_node_registered(n, r.running_job(), Clock::now());
  log::info(members_.describe_node(n), " registered as node ", n.index, ", control ", n.control_address,
            ", metrics ", n.metrics_address.empty() ? "off" : n.metrics_address);
  v1::Envelope reply;
  auto* rr = reply.mutable_register_node_reply();
  rr->set_node_index(n.index);
  rr->set_rank_base(n.index * members_.devices_per_node());
  rr->set_devices_per_node(members_.devices_per_node());
  rr->set_heartbeat_interval_ms(opts_.heartbeat_interval.count());
  rr->set_agent_incarnation(incarnation_);
  write_scrape_targets();
  persist();
  schedule_soon();
  return reply;
}

// Publishes a rank's bytes and answers, once every rank has published, with all
// of them (or an error naming the first rank that did not publish in time).
rpc::awaitable<v1::Envelope> Agent::on_bootstrap(const v1::BootstrapPublish& p, const rpc::RequestContext& ctx) {
  const std::string id = p.job_id();
  auto ended = [&] {
    const RunningJob* job = scheduler_.running();
    return !job || job->id != id || job->ending();
  };
  if (ended() || relay_.job_id() != id)
    throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "job " + id + " is not running");
  if (p.world_epoch() != relay_.epoch())
    throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "job " + id + " runs world " + std::to_string(relay_.epoch()) +
                                                           ", not world " + std::to_string(p.world_epoch()));
  if (p.rank() < 0 || p.rank() >= static_cast<int>(relay_.blobs().size()))
    throw InvalidArgument("rank: " + std::to_string(p.rank()) + " out of range");
  relay_.publish(p.rank(), p.blob());
  scheduler_.on_activity(id, Clock::now());
  bootstrap_event_.notify_all();
  const int64_t epoch = p.world_epoch();
  auto superseded = [&] {
    const RunningJob* job = scheduler_.running();
    return relay_.epoch() != epoch || (job && job->halt && job->world_epoch == epoch);
  };
  while (!ended() && !superseded() && !relay_.complete() && Clock::now() < ctx.deadline)
    co_await bootstrap_event_.wait(ctx.deadline);
  if (!ended() && superseded())
    throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION,
                   "job " + id + ": world " + std::to_string(epoch) + " halted during its transport bootstrap");
  if (ended()) {
    const RunningJob* job = scheduler_.running();
    throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION,
                   "job " + id + " ended during the transport bootstrap" +
                       (job && job->id == id ? ": " + job->message : std::string()));
  }
  if (!relay_.complete())
    throw RpcError(v1::ERROR_CODE_DEADLINE_EXCEEDED, "transport bootstrap: " +
                                                         members_.describe_rank(relay_.first_missing()) +
                                                         " did not publish its address in time");
  v1::Envelope reply;
  for (const auto& b : relay_.blobs()) reply.mutable_bootstrap_addresses()->add_blobs(b);
  co_return reply;
}

// Forgets a shape's placement (docs/placement.md#cluster-state); not while a job runs on it.
v1::Envelope Agent::on_placement_reset(const v1::PlacementReset& r) {
  const ShapeKey shape = placement_.resolve(ShapeKey::of(r.shape()));
  if (shape.empty()) throw RpcError(v1::ERROR_CODE_NOT_FOUND, "no placement yet (no job has run): nothing to reset");
  if (const RunningJob* job = scheduler_.running(); job && job->shape == shape)
    throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION,
                   "job " + job->id + " runs on the shape " + shape.flag() + "; reset it when the job ends");
  placement_.reset(shape);
  log::info("placement: reset ", shape.name(), "; its next job starts afresh");
  persist();
  v1::Envelope reply;
  v1::PlacementReply* left = reply.mutable_placement_reply();  // the shapes left, and the one reset
  *left = placement_.describe(ShapeKey{}, std::nullopt);
  left->clear_layers();
  left->clear_maps();
  *left->mutable_shape() = shape.proto();
  return reply;
}

// Installs imported maps as a new epoch of their shape; the next job of the shape
// starts on them. A running job of the shape keeps its maps (rebalance moves it).
v1::Envelope Agent::on_import(const v1::PlacementImport& imp) {
  const ShapeKey shape = ShapeKey::of(imp.shape());
  if (const RunningJob* job = scheduler_.running(); job && job->shape == shape)
    throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION,
                   "job " + job->id + " runs on the shape " + shape.name() +
                       "; import when it ends, or move it with placement rebalance");
  const int64_t epoch = placement_.install(shape, {imp.maps().begin(), imp.maps().end()}, 0, "placement import");
  log::info("placement: imported ", imp.maps_size(), " map(s) of ", shape.name(), " as epoch ", epoch);
  persist();
  v1::Envelope reply;
  *reply.mutable_placement_reply() = placement_.describe(shape, std::nullopt);
  return reply;
}

v1::Envelope Agent::on_rank_done(const v1::RankDone& d) {
  // The node may still be busy with a job the agent already ended.
  const int home = d.has_node_rank() ? d.node_rank() : scheduler_.home_rank(d.rank(), d.world_epoch());
  if (members_.rank_done(d.job_id(), home)) {
    schedule_soon();
    const int D = members_.devices_per_node();
    if (D > 0 && home / D < members_.num_nodes()) scheduler_.on_node_idle(members_.nodes()[home / D], Clock::now());
  }
  scheduler_.on_rank_done(d, Clock::now());
  persist_soon();
  return report_ack(d.job_id());
}

rpc::awaitable<v1::Envelope> Agent::on_wait(const v1::WaitJobRequest& r, const rpc::RequestContext& ctx) {
  const std::string id = r.job_id();
  scheduler_.record(id);  // NOT_FOUND before waiting
  auto answered = [&] {
    const v1::JobResult& rec = scheduler_.record(id);
    if (Scheduler::finished(rec.state())) return true;
    return r.has_after_step() && rec.state() == v1::JOB_STATE_RUNNING && rec.progress().step() > r.after_step();
  };
  while (!answered() && Clock::now() < ctx.deadline) co_await job_event_.wait(ctx.deadline);
  v1::Envelope reply;
  *reply.mutable_job() = scheduler_.view(id);
  co_return reply;
}

v1::Envelope Agent::cluster_status() const {
  v1::Envelope reply;
  auto* s = reply.mutable_cluster_status_reply();
  members_.fill_status(*s, Clock::now());
  if (const RunningJob* job = scheduler_.running()) s->set_running_job(job->id);
  s->set_queued_jobs(scheduler_.queued());
  s->set_agent_address(server_->address());
  s->set_agent_metrics_address(opts_.metrics_address);
  if (!persist_error_.empty()) {
    s->set_state_error(persist_error_);
    s->set_state_error_since_unix_ms(persist_error_since_);
  }
  return reply;
}

rpc::awaitable<void> Agent::watchdog() {
  rpc::asio::steady_timer timer(io_);
  const Clock::duration period = opts_.heartbeat_interval / 2;
  Clock::time_point last = Clock::now();
  while (!stopped_) {
    timer.expires_after(period);
    boost::system::error_code ec;
    co_await timer.async_wait(rpc::asio::redirect_error(rpc::use_awaitable, ec));
    if (stopped_) co_return;
    const auto now = Clock::now();
    // A tick a quarter of the dead-node timeout late: the agent itself stood still
    // (SIGSTOP, a paused VM). The nodes' heartbeats of that time are still unread,
    // so their silence is not held against them (docs/jobs.md#dead-nodes). Shorter
    // delays (a loaded host) count as silence.
    const Clock::duration stalled = now - last - period;
    if (stalled > std::max<Clock::duration>(opts_.heartbeat_interval, dead_node_timeout() / 4)) {
      log::warn("the agent did not run for ", std::chrono::duration_cast<std::chrono::milliseconds>(stalled).count(),
                " ms (stopped or paused): the nodes' silence during it does not count");
      members_.forgive_stall(last + period, now);
    }
    last = now;
    for (const int index : members_.expire(now, dead_node_timeout())) {
      const NodeRecord& n = members_.nodes()[index];
      if (n.restored) {  // read back from the state dir, never heard from since
        log::warn(members_.describe_node(n), " did not re-register within ", opts_.heartbeat_timeout.count(),
                  " ms of the agent's start: dead");
        scheduler_.on_node_dead(members_.describe_node(n) + " did not re-register", now, index);
        continue;
      }
      log::warn(members_.describe_node(n), " missed heartbeats for ",
                std::chrono::duration_cast<std::chrono::milliseconds>(now - n.last_heartbeat).count(), " ms: dead");
      scheduler_.on_node_dead(members_.describe_node(n) + " stopped responding", now, index);
    }
    scheduler_.tick(now);
    rebalancer_.tick(now);
    // A failed write is tried again though nothing changed: a disk that was
    // full may have room again.
    if (!persist_error_.empty() && now - last_persist_ > kStateRetryInterval) persist();
  }
}

// The silence that makes a node dead now: the running job's own timeout, if it
// set one, else --heartbeat-timeout-ms.
Clock::duration Agent::dead_node_timeout() const {
  const RunningJob* job = scheduler_.running();
  if (!job || job->reports.spec.dead_node_timeout_ms() <= 0) return opts_.heartbeat_timeout;
  return std::chrono::milliseconds(job->reports.spec.dead_node_timeout_ms());
}

void Agent::write_scrape_targets() const {
  if (opts_.prometheus_sd_file.empty()) return;
  std::vector<ScrapeTarget> targets = {{opts_.metrics_address, "agent", opts_.name}};
  for (const NodeRecord& n : members_.nodes()) targets.push_back({n.metrics_address, "moed", n.name});
  try {
    const auto dir = std::filesystem::path(opts_.prometheus_sd_file).parent_path();
    if (!dir.empty()) std::filesystem::create_directories(dir);
    write_file_atomically(opts_.prometheus_sd_file, file_sd_json(targets));
  } catch (const moe::Error& e) {
    log::warn("prometheus file_sd: ", e.what());
  }
}

rpc::awaitable<v1::Envelope> Agent::on_rebalance(const v1::RebalanceRequest& r, const rpc::RequestContext& ctx) {
  const uint64_t id = rebalancer_.start(r, Clock::now());
  while (!rebalancer_.result(id) && Clock::now() < ctx.deadline) co_await rebalance_event_.wait(ctx.deadline);
  const v1::RebalanceReply* done = rebalancer_.result(id);
  if (!done) throw RpcError(v1::ERROR_CODE_DEADLINE_EXCEEDED, "the rebalance is still running; see placement show");
  v1::Envelope reply;
  *reply.mutable_rebalance_reply() = *done;
  co_return reply;
}

// Auto-rebalance (agent flags; the gates in auto_rebalance.h).
void Agent::maybe_auto_rebalance(const std::string& job_id, int step) {
  if (rebalancer_.in_flight() || !auto_gate_.due(job_id, step)) return;
  const RunningJob* job = scheduler_.running();
  if (!job) return;
  try {
    const RebalancePlan plan = placement_.plan(job->shape, opts_.redundant_experts, std::nullopt);
    double before = 0, after = 0;
    for (size_t l = 0; l < plan.maps.size(); ++l) {
      before += plan.before[l] / plan.maps.size();
      after += plan.predicted[l] / plan.maps.size();
    }
    if (!auto_gate_.worth(before, after, plan.copies.size())) return;
    log::info("auto-rebalance: job ", job_id, " at step ", step, ": balancedness ", before, ", predicted ", after);
    v1::RebalanceRequest req;
    if (opts_.redundant_experts) req.set_redundant_experts(*opts_.redundant_experts);
    rebalancer_.start(req, Clock::now());
  } catch (const std::exception& e) {
    // Counted as a failed rebalance (the alert on result="failed" fires) and
    // shown on the job: a WARN in agent.log alone is seen by nobody.
    const std::string why = "auto-rebalance at step " + std::to_string(step) + " failed: " + e.what();
    log::warn(why);
    rebalancer_.record_failed_attempt();
    scheduler_.note_rebalance(job_id, why);
    persist_soon();
  }
}

void Agent::step_completed(const std::string& job_id, int step) {
  job_event_.notify_all();  // watchers of the job's progress
  rpc::asio::post(io_, [this, job_id, step] { maybe_auto_rebalance(job_id, step); });
}

void Agent::to_every_node(const v1::Envelope& req,
                          std::function<void(const std::string&, const std::string&)> on_error) {
  for (const NodeRecord& n : members_.nodes()) {
    if (n.state != v1::NODE_STATE_ALIVE) continue;
    const std::string name = n.name;
    outbound_->post(n.control_address, [this, req, name, on_error](rpc::RpcClient& daemon) {
      try {
        daemon.call(req, opts_.daemon_call_timeout);
      } catch (const std::exception& e) {
        const std::string error = e.what();
        log::warn(rpc::payload_name(req), " to ", name, ": ", error);
        if (on_error) rpc::asio::post(io_, [on_error, name, error] { on_error(name, error); });
      }
    });
  }
}

void Agent::prepare(const v1::PrepareRebalance& p) {
  v1::Envelope req;
  *req.mutable_prepare_rebalance() = p;
  const int64_t epoch = p.epoch();
  persist();  // the reserved epoch: epochs only grow, across restarts too
  to_every_node(req, [this, epoch](const std::string& node, const std::string& error) {
    rebalancer_.on_prepare_failed(epoch, node, error, Clock::now());
  });
}

// A committed epoch is never aborted: a COMMIT that does not reach a live node is
// sent again (its ranks wait for it before they switch).
void Agent::commit(const v1::CommitRebalance& c) {
  persist();  // the new epoch
  for (const NodeRecord& n : members_.nodes())
    if (n.state == v1::NODE_STATE_ALIVE) send_commit(c, n.name, 1);
}

void Agent::send_commit(const v1::CommitRebalance& c, const std::string& node, int attempt) {
  const auto n = std::find_if(members_.nodes().begin(), members_.nodes().end(),
                              [&](const NodeRecord& r) { return r.name == node; });
  if (n == members_.nodes().end() || n->state != v1::NODE_STATE_ALIVE || attempt > 5) return;
  v1::Envelope req;
  *req.mutable_commit_rebalance() = c;
  outbound_->post(n->control_address, [this, req, c, node, attempt](rpc::RpcClient& daemon) {
    try {
      daemon.call(req, opts_.daemon_call_timeout);
    } catch (const std::exception& e) {
      log::warn("COMMIT of epoch ", c.epoch(), " to ", node, " (attempt ", attempt, "): ", e.what());
      rpc::asio::post(io_, [this, c, node, attempt] { send_commit(c, node, attempt + 1); });
    }
  });
}

void Agent::abort(const v1::AbortRebalance& a) {
  v1::Envelope req;
  *req.mutable_abort_rebalance() = a;
  to_every_node(req, nullptr);
}

void Agent::rebalance_done(const v1::RebalanceReply&) {
  persist();
  rebalance_event_.notify_all();
}

void Agent::start_job(const v1::StartJob& start) {
  job_event_.notify_all();  // watchers of a queued job see it start
  relay_.begin(start.job_id(), start.world_size());
  persist();
  v1::Envelope req;
  *req.mutable_start_job() = start;
  for (const NodeRecord& n : members_.nodes()) {
    const std::string id = start.job_id(), name = n.name;
    outbound_->post(n.control_address, [this, req, id, name](rpc::RpcClient& daemon) {
      std::optional<std::string> error;
      try {
        daemon.call(req, opts_.daemon_call_timeout);
      } catch (const std::exception& e) {
        error = e.what();
      }
      if (error)
        rpc::asio::post(io_, [this, id, name, error] { scheduler_.on_start_failed(id, name, *error, Clock::now()); });
    });
  }
}

void Agent::cancel_job(const std::string& job_id, const std::string& reason, bool failed) {
  for (const NodeRecord& n : members_.nodes())
    if (n.state == v1::NODE_STATE_ALIVE) send_cancel(n, job_id, reason, failed);
}

// CancelJob to one node; a failure is logged (the node is dead or will be).
void Agent::send_cancel(const NodeRecord& n, const std::string& job_id, const std::string& reason, bool failed) {
  v1::Envelope req;
  req.mutable_cancel_job()->set_job_id(job_id);
  req.mutable_cancel_job()->set_reason(reason);
  req.mutable_cancel_job()->set_failed(failed);
  outbound_->post(n.control_address, [this, req](rpc::RpcClient& daemon) {
    try {
      daemon.call(req, opts_.daemon_call_timeout);
    } catch (const std::exception& e) {
      log::warn("cancel on ", daemon.address(), ": ", e.what());
    }
  });
}

// Elastic jobs: HaltWorld to each node of the world, with a short deadline (a
// node that cannot be told is lost: the world change goes on without it).
void Agent::halt_world(const std::string& job_id, int64_t epoch, const std::string& reason,
                       const std::vector<int>& nodes) {
  rebalancer_.on_world_halted(job_id, reason, Clock::now());
  bootstrap_event_.notify_all();  // a bootstrap of the halted world ends
  v1::Envelope req;
  req.mutable_halt_world()->set_job_id(job_id);
  req.mutable_halt_world()->set_world_epoch(epoch);
  req.mutable_halt_world()->set_reason(reason);
  for (const int index : nodes) {
    const NodeRecord& n = members_.nodes()[index];
    outbound_->post(n.control_address, [this, req, job_id, epoch, index](rpc::RpcClient& daemon) {
      try {
        daemon.call(req, opts_.halt_call_timeout);
      } catch (const rpc::RpcError& e) {
        // FAILED_PRECONDITION: the node's part of the job has ended already.
        const bool ended = e.code() == v1::ERROR_CODE_FAILED_PRECONDITION;
        const std::string error = e.what();
        rpc::asio::post(io_, [this, job_id, epoch, index, error, ended] {
          if (ended)
            scheduler_.on_halt_found_ended(job_id, epoch, index, Clock::now());
          else
            scheduler_.on_halt_failed(job_id, epoch, index, error, Clock::now());
        });
      } catch (const std::exception& e) {
        const std::string error = e.what();
        rpc::asio::post(io_, [this, job_id, epoch, index, error] {
          scheduler_.on_halt_failed(job_id, epoch, index, error, Clock::now());
        });
      }
    });
  }
}

void Agent::new_world(const v1::NewWorld& world, const std::vector<int>& nodes, const v1::StartJob& join,
                      const std::vector<int>& joining) {
  relay_.begin(world.job_id(), world.world_size(), world.world_epoch());
  bootstrap_event_.notify_all();  // publishes for the old world end
  job_event_.notify_all();
  persist();
  v1::Envelope req, start;
  *req.mutable_new_world() = world;
  *start.mutable_start_job() = join;
  for (const int index : joining) tell_world(index, start, world);
  for (const int index : nodes) tell_world(index, req, world);
}

// NewWorld to a survivor, or StartJob with join to a joining node.
void Agent::tell_world(int index, const v1::Envelope& req, const v1::NewWorld& world) {
  const NodeRecord& n = members_.nodes()[index];
  const std::string id = world.job_id(), name = n.name;
  const std::string what = "moving to world " + std::to_string(world.world_epoch()) + ": ";
  outbound_->post(n.control_address, [this, req, id, name, what](rpc::RpcClient& daemon) {
    try {
      daemon.call(req, opts_.daemon_call_timeout);
    } catch (const std::exception& e) {
      const std::string error = what + e.what();
      rpc::asio::post(io_, [this, id, name, error] { scheduler_.on_start_failed(id, name, error, Clock::now()); });
    }
  });
}

void Agent::fence(const std::string& job_id, int node, const std::string& reason) {
  const NodeRecord& n = members_.nodes()[node];
  log::warn("job ", job_id, ": fencing ", members_.describe_node(n), ": ", reason);
  send_cancel(n, job_id, reason, true);
}

void Agent::job_ended(const v1::JobResult& result) {
  rebalancer_.on_job_ended(result.job_id(), result.message().empty() ? v1::JobState_Name(result.state()).substr(10)  // drop JOB_STATE_
                                                                    : result.message(),
                           Clock::now());
  if (scheduler_.running() == nullptr) relay_.clear();
  persist();
  job_event_.notify_all();
  bootstrap_event_.notify_all();
  schedule_soon();
}

}  // namespace moe::agent
