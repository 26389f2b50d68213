#include "moe/agent/agent.h"

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "moe/base/check.h"
#include "moe/placement/placement_solver.h"
#include "moe/base/clock.h"
#include "moe/base/log.h"
#include "moe/spec/job_spec.h"

namespace moe::agent {

using Clock = std::chrono::steady_clock;
using rpc::RpcError;

// Runs blocking calls to daemons off the io thread, one at a time, in order.
class Outbound {
 public:
  Outbound() : thread_([this] { loop(); }) {}
  ~Outbound() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }
  rpc::RpcClient& client(const std::string& address, const std::string& token) {
    auto& c = clients_[address];
    if (!c) c = std::make_unique<rpc::RpcClient>(rpc::ClientOptions::make(address, token, "moe-agent", "agent"));
    return *c;
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (stop_) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::map<std::string, std::unique_ptr<rpc::RpcClient>> clients_;  // outbound thread only
  std::thread thread_;
};

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A job's first map of one layer, from the solver: no redundant slots yet, and no
// measured loads yet (every expert weighs the same), so it is the solver's
// balanced packing with groups kept on few nodes.
v1::PlacementMap initial_map(int layer, const v1::JobSpec& spec, int world, int nodes, int64_t epoch) {
  placement::PlacementSpec ps;
  ps.num_experts = spec.experts();
  ps.num_ranks = world;
  ps.num_nodes = nodes;
  ps.num_redundant = 0;
  ps.num_groups = spec.num_groups() > 1 && spec.num_groups() % nodes == 0 ? spec.num_groups() : 0;
  ps.top_k = spec.top_k();
  ps.group_top_k = ps.num_groups > 1 ? spec.group_top_k() : 0;
  const std::vector<double> loads(spec.experts(), 1.0);
  const placement::LayerMap lm = placement::solve_layer(ps, loads);
  v1::PlacementMap m;
  m.set_epoch(epoch);
  m.set_layer(layer);
  m.set_num_experts(lm.num_experts);
  m.set_num_ranks(lm.num_ranks);
  m.set_slots_per_rank(lm.slots_per_rank);
  *m.mutable_phy2log() = {lm.phy2log.begin(), lm.phy2log.end()};
  *m.mutable_logcnt() = {lm.logcnt.begin(), lm.logcnt.end()};
  return m;
}

}  // namespace

Agent::Agent(rpc::asio::io_context& io, AgentOptions options)
    : io_(io), opts_(std::move(options)), outbound_(std::make_unique<Outbound>()), job_event_(io), bootstrap_event_(io) {
  server_ = std::make_unique<rpc::RpcServer>(
      io_, rpc::ServerOptions::make(opts_.listen, opts_.token, "moe-agent"), [this](const v1::Envelope& req, const rpc::RequestContext& ctx) { return handle(req, ctx); });
  rpc::asio::co_spawn(io_, watchdog(), rpc::asio::detached);
  log::info("listening on ", server_->address(), opts_.token.empty() ? " (no token)" : "");
}

Agent::~Agent() { stop(); }

void Agent::stop() {
  if (stopped_) return;
  stopped_ = true;
  server_->stop();
  outbound_.reset();  // joins: no task touches the agent after this
}

int Agent::world_size() const { return static_cast<int>(nodes_.size()) * devices_per_node_; }

std::string Agent::describe_rank(int rank) const {
  if (devices_per_node_ <= 0) return "rank " + std::to_string(rank);
  const int node = rank / devices_per_node_;
  if (node < 0 || node >= static_cast<int>(nodes_.size())) return "rank " + std::to_string(rank);
  return "rank " + std::to_string(rank) + " (node " + nodes_[node].name + ")";
}

v1::JobResult& Agent::record(const std::string& job_id) {
  const auto it = jobs_.find(job_id);
  if (it == jobs_.end()) throw RpcError(v1::ERROR_CODE_NOT_FOUND, "no job '" + job_id + "'");
  return it->second;
}

rpc::awaitable<v1::Envelope> Agent::handle(const v1::Envelope& req, const rpc::RequestContext& ctx) {
  using E = v1::Envelope;
  switch (req.payload_case()) {
    case E::kRegisterNode:
      co_return on_register(req.register_node());
    case E::kHeartbeat:
      co_return on_heartbeat(req.heartbeat());
    case E::kBootstrapPublish:
      co_return co_await on_bootstrap(req.bootstrap_publish(), ctx);
    case E::kStepReport:
      co_return on_step(req.step_report());
    case E::kRankDone:
      co_return on_rank_done(req.rank_done());
    case E::kSubmitJob:
      co_return on_submit(req.submit_job());
    case E::kGetJob: {
      E reply;
      *reply.mutable_job() = record(req.get_job().job_id());
      co_return reply;
    }
    case E::kWaitJob:
      co_return co_await on_wait(req.wait_job(), ctx);
    case E::kListJobs: {
      E reply;
      for (const auto& [id, job] : jobs_) *reply.mutable_list_jobs_reply()->add_jobs() = job;
      co_return reply;
    }
    case E::kCancelJobRequest:
      co_return on_cancel(req.cancel_job_request());
    case E::kClusterStatus:
      co_return cluster_status();
    case E::kPlacement: {
      E reply;
      for (const auto& m : maps_) *reply.mutable_placement_reply()->add_maps() = m;
      co_return reply;
    }
    default:
      throw RpcError(v1::ERROR_CODE_INVALID_ARGUMENT, "moe-agent does not serve " + rpc::payload_name(req));
  }
}

v1::Envelope Agent::on_register(const v1::RegisterNodeRequest& r) {
  if (r.name().empty()) throw RpcError(v1::ERROR_CODE_INVALID_ARGUMENT, "name: a node needs a name");
  if (r.devices() < 1) throw RpcError(v1::ERROR_CODE_INVALID_ARGUMENT, "devices: must be >= 1");
  if (devices_per_node_ == 0) devices_per_node_ = r.devices();
  if (r.devices() != devices_per_node_)
    throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION,
                   "devices: node " + r.name() + " has " + std::to_string(r.devices()) + ", the cluster's nodes have " +
                       std::to_string(devices_per_node_));
  auto it = std::find_if(nodes_.begin(), nodes_.end(), [&](const Node& n) { return n.name == r.name(); });
  if (it == nodes_.end()) {
    if (running_)
      throw RpcError(v1::ERROR_CODE_UNAVAILABLE, "a job is running; node " + r.name() + " can join when it ends");
    Node n;
    n.name = r.name();
    n.index = static_cast<int>(nodes_.size());
    nodes_.push_back(n);
    it = nodes_.end() - 1;
  }
  Node& n = *it;
  n.state = v1::NODE_STATE_ALIVE;
  // A restarted daemon runs nothing; one we took for dead may still be winding
  // down a job, and stays busy until its ranks report.
  n.busy_job = r.running_job();
  n.busy_ranks = r.running_job().empty() ? 0 : r.devices();
  n.devices = r.devices();
  n.control_address = r.control_address();
  n.metrics_address = r.metrics_address();
  n.last_heartbeat = Clock::now();
  log::info("node ", n.name, " registered as node ", n.index, " (ranks ", n.index * devices_per_node_, "-",
            (n.index + 1) * devices_per_node_ - 1, "), control ", n.control_address);
  v1::Envelope reply;
  auto* rr = reply.mutable_register_node_reply();
  rr->set_node_index(n.index);
  rr->set_rank_base(n.index * devices_per_node_);
  rr->set_devices_per_node(devices_per_node_);
  rr->set_heartbeat_interval_ms(opts_.heartbeat_interval.count());
  rpc::asio::post(io_, [this] { try_schedule(); });
  return reply;
}

v1::Envelope Agent::on_heartbeat(const v1::HeartbeatRequest& r) {
  v1::Envelope reply;
  const bool known = r.node_index() >= 0 && r.node_index() < static_cast<int>(nodes_.size()) &&
                     nodes_[r.node_index()].name == r.name() && nodes_[r.node_index()].state == v1::NODE_STATE_ALIVE;
  if (known) nodes_[r.node_index()].last_heartbeat = Clock::now();
  reply.mutable_heartbeat_reply()->set_known(known);
  return reply;
}

rpc::awaitable<v1::Envelope> Agent::on_bootstrap(const v1::BootstrapPublish& p, const rpc::RequestContext& ctx) {
  if (!running_ || running_->id != p.job_id())
    throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "job " + p.job_id() + " is not running");
  Running* job = running_.get();
  if (p.rank() < 0 || p.rank() >= job->world)
    throw RpcError(v1::ERROR_CODE_INVALID_ARGUMENT, "rank: " + std::to_string(p.rank()) + " out of range");
  job->last_report = Clock::now();
  if (!job->published[p.rank()]) ++job->published_count;
  job->published[p.rank()] = true;
  job->blobs[p.rank()] = p.blob();
  bootstrap_event_.notify_all();
  const std::string id = p.job_id();
  auto ended = [&] { return !running_ || running_->id != id || running_->failed || running_->cancelled; };
  while (!ended() && running_->published_count < running_->world && Clock::now() < ctx.deadline)
    co_await bootstrap_event_.wait(ctx.deadline);
  if (ended())
    throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION,
                   "job " + id + " ended during the transport bootstrap" +
                       (running_ && running_->id == id ? ": " + running_->message : std::string()));
  if (running_->published_count < running_->world) {
    int missing = 0;
    while (running_->published[missing]) ++missing;
    throw RpcError(v1::ERROR_CODE_DEADLINE_EXCEEDED,
                   "transport bootstrap: " + describe_rank(missing) + " did not publish its address in time");
  }
  v1::Envelope reply;
  for (const auto& b : running_->blobs) reply.mutable_bootstrap_addresses()->add_blobs(b);
  co_return reply;
}

v1::Envelope Agent::on_step(const v1::StepReport& r) {
  if (running_ && running_->id == r.job_id() && r.rank() >= 0 && r.rank() < running_->world) {
    auto& by_rank = running_->steps[r.stats().step()];
    by_rank.resize(running_->world);
    by_rank[r.rank()] = r.stats();
    running_->last_report = Clock::now();
    int reported = 0;
    for (const auto& s : by_rank) reported += s.step_seconds() > 0;
    if (reported == running_->world) {  // progress shows in `job status` while it runs
      v1::JobResult& rec = jobs_.at(r.job_id());
      rec.set_steps_completed(std::max(rec.steps_completed(), static_cast<double>(r.stats().step() + 1)));
    }
  }
  v1::Envelope reply;
  reply.mutable_ack();
  return reply;
}

v1::Envelope Agent::on_rank_done(const v1::RankDone& d) {
  v1::Envelope reply;
  reply.mutable_ack();
  if (devices_per_node_ > 0 && d.rank() >= 0) {
    const int node = d.rank() / devices_per_node_;
    if (node < static_cast<int>(nodes_.size()) && nodes_[node].busy_job == d.job_id() && --nodes_[node].busy_ranks <= 0) {
      nodes_[node].busy_job.clear();
      nodes_[node].busy_ranks = 0;
      rpc::asio::post(io_, [this] { try_schedule(); });
    }
  }
  if (!running_ || running_->id != d.job_id() || d.rank() < 0 || d.rank() >= running_->world) return reply;
  Running& job = *running_;
  if (!job.done[d.rank()]) {
    job.done[d.rank()] = true;
    ++job.done_count;
  }
  job.verify[d.rank()] = d.verify();
  job.last_report = Clock::now();
  if (!d.ok() && d.cancelled() && !job.failed && (!job.cancelled || (d.cancel_requested_here() && !job.reason_known))) {
    // Stopped without our asking (a daemon shutting down): the job is cancelled.
    // The reason is the one from the rank whose daemon was asked, whichever
    // rank's report arrives first.
    if (!job.cancelled) job.failed_at = Clock::now();
    job.cancelled = true;
    job.reason_known = d.cancel_requested_here();
    job.message = describe_rank(d.rank()) + ": " + d.message();
  }
  if (!d.ok() && !d.cancelled() && !job.failed && !job.cancelled) {
    log::warn("job ", job.id, ": ", describe_rank(d.rank()), " failed: ", d.message());
    // Name the rank (and node) the error blames when the reporter knows it.
    if (d.has_failed_peer() && d.failed_peer() >= 0 && d.failed_peer() != d.rank())
      fail_running(describe_rank(d.failed_peer()) + " failed (reported by " + describe_rank(d.rank()) +
                   "): " + d.message());
    else
      fail_running(describe_rank(d.rank()) + ": " + d.message());
    return reply;
  }
  if (job.done_count == job.world) {
    if (job.cancelled) finish(v1::JOB_STATE_CANCELLED, job.message);
    else if (job.failed) finish(v1::JOB_STATE_FAILED, job.message);
    else finish(v1::JOB_STATE_SUCCEEDED, "");
  }
  return reply;
}

v1::Envelope Agent::on_submit(const v1::SubmitJobRequest& r) {
  v1::JobSpec spec = r.spec();
  spec::fill_defaults(spec);
  spec::validate(spec, world_size());
  const std::string id = "job-" + std::to_string(next_job_++);
  v1::JobResult& rec = jobs_[id];
  rec.set_job_id(id);
  rec.set_state(v1::JOB_STATE_QUEUED);
  *rec.mutable_spec() = spec;
  rec.set_submitted_unix_ms(unix_ms());
  queue_.push_back(id);
  log::info("job ", id, " queued (", spec.experts(), " experts, top-", spec.top_k(), ", ", spec.layers(), " layers, ",
            spec.steps(), " steps)");
  rpc::asio::post(io_, [this] { try_schedule(); });
  v1::Envelope reply;
  *reply.mutable_job() = rec;
  return reply;
}

rpc::awaitable<v1::Envelope> Agent::on_wait(const v1::WaitJobRequest& r, const rpc::RequestContext& ctx) {
  const std::string id = r.job_id();
  record(id);  // NOT_FOUND before waiting
  auto finished = [&] {
    const auto s = jobs_.at(id).state();
    return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED || s == v1::JOB_STATE_CANCELLED;
  };
  while (!finished() && Clock::now() < ctx.deadline) co_await job_event_.wait(ctx.deadline);
  v1::Envelope reply;
  *reply.mutable_job() = jobs_.at(id);
  co_return reply;
}

v1::Envelope Agent::on_cancel(const v1::CancelJobRequest& r) {
  v1::JobResult& rec = record(r.job_id());
  if (rec.state() == v1::JOB_STATE_QUEUED) {
    queue_.erase(std::remove(queue_.begin(), queue_.end(), r.job_id()), queue_.end());
    rec.set_state(v1::JOB_STATE_CANCELLED);
    rec.set_message("cancelled before it started");
    rec.set_finished_unix_ms(unix_ms());
    job_event_.notify_all();
  } else if (rec.state() == v1::JOB_STATE_RUNNING && running_ && !running_->cancelled && !running_->failed) {
    running_->cancelled = true;
    running_->reason_known = true;
    running_->failed_at = Clock::now();
    running_->message = "cancelled";
    log::info("job ", rec.job_id(), ": cancelling");
    cancel_daemons("cancelled by request");
  }
  v1::Envelope reply;
  *reply.mutable_job() = rec;
  return reply;
}

v1::Envelope Agent::cluster_status() const {
  v1::Envelope reply;
  auto* s = reply.mutable_cluster_status_reply();
  const auto now = Clock::now();
  for (const Node& n : nodes_) {
    auto* i = s->add_nodes();
    i->set_name(n.name);
    i->set_node_index(n.index);
    i->set_state(n.state);
    i->set_devices(n.devices);
    i->set_rank_base(n.index * devices_per_node_);
    i->set_control_address(n.control_address);
    i->set_metrics_address(n.metrics_address);
    i->set_last_heartbeat_age_seconds(std::chrono::duration<double>(now - n.last_heartbeat).count());
  }
  s->set_devices_per_node(devices_per_node_);
  int alive = 0;
  for (const Node& n : nodes_) alive += n.state == v1::NODE_STATE_ALIVE;
  s->set_world_size(alive * devices_per_node_);
  if (running_) s->set_running_job(running_->id);
  s->set_queued_jobs(static_cast<int>(queue_.size()));
  return reply;
}

std::map<v1::NodeState, int> Agent::node_counts() const {
  std::map<v1::NodeState, int> c = {{v1::NODE_STATE_ALIVE, 0}, {v1::NODE_STATE_DEAD, 0}};
  for (const Node& n : nodes_) ++c[n.state];
  return c;
}

std::map<v1::JobState, int> Agent::job_counts() const {
  std::map<v1::JobState, int> c;
  for (int s = v1::JOB_STATE_QUEUED; s <= v1::JOB_STATE_CANCELLED; ++s) c[static_cast<v1::JobState>(s)] = 0;
  for (const auto& [id, j] : jobs_) ++c[j.state()];
  return c;
}

rpc::awaitable<void> Agent::watchdog() {
  rpc::asio::steady_timer timer(io_);
  while (!stopped_) {
    timer.expires_after(opts_.heartbeat_interval / 2);
    boost::system::error_code ec;
    co_await timer.async_wait(rpc::asio::redirect_error(rpc::use_awaitable, ec));
    if (stopped_) co_return;
    const auto now = Clock::now();
    for (Node& n : nodes_) {
      if (n.state != v1::NODE_STATE_ALIVE || now - n.last_heartbeat <= opts_.heartbeat_timeout) continue;
      n.state = v1::NODE_STATE_DEAD;
      const int first = n.index * devices_per_node_, last = first + devices_per_node_ - 1;
      log::warn("node ", n.name, " (ranks ", first, "-", last, ") missed heartbeats for ",
                std::chrono::duration_cast<std::chrono::milliseconds>(now - n.last_heartbeat).count(), " ms: dead");
      n.busy_job.clear();  // a dead daemon runs nothing
      n.busy_ranks = 0;
      const std::string why =
          "node " + n.name + " (ranks " + std::to_string(first) + "-" + std::to_string(last) + ") stopped responding";
      if (running_ && !running_->failed && !running_->cancelled) fail_running(why);
      else if (running_) finish(v1::JOB_STATE_FAILED, running_->message + "; " + why);  // it will never report
    }
    if (running_ && (running_->failed || running_->cancelled) && now - running_->failed_at > opts_.failed_job_grace)
      finish(running_->failed ? v1::JOB_STATE_FAILED : v1::JOB_STATE_CANCELLED,
             running_->message + " (not every rank reported back)");
    else if (running_ && now - running_->last_report > opts_.stale_job_timeout)
      fail_running("no rank reported for " +
                   std::to_string(std::chrono::duration_cast<std::chrono::seconds>(opts_.stale_job_timeout).count()) +
                   " s");
  }
}

void Agent::try_schedule() {
  if (stopped_ || running_ || queue_.empty() || nodes_.empty()) return;
  for (const Node& n : nodes_)
    if (n.state != v1::NODE_STATE_ALIVE || !n.busy_job.empty()) return;  // every rank takes part: wait for the node
  start(queue_.front());
  queue_.pop_front();
}

void Agent::start(const std::string& id) {
  v1::JobResult& rec = jobs_.at(id);
  const int world = world_size();
  try {
    spec::validate(rec.spec(), world);
  } catch (const RpcError& e) {
    fail_unstarted(rec, e.what());
    return;
  }
  running_ = std::make_unique<Running>();
  Running& job = *running_;
  job.id = id;
  job.spec = rec.spec();
  job.world = world;
  job.blobs.assign(world, "");
  job.published.assign(world, false);
  job.done.assign(world, false);
  job.verify.assign(world, {});
  job.last_report = Clock::now();
  rec.set_state(v1::JOB_STATE_RUNNING);
  ++placement_epoch_;
  maps_.clear();
  try {
    const v1::PlacementMap first = initial_map(0, job.spec, world, static_cast<int>(nodes_.size()), placement_epoch_);
    for (int l = 0; l < job.spec.layers(); ++l) {
      maps_.push_back(first);
      maps_.back().set_layer(l);
    }
  } catch (const moe::Error& e) {
    running_.reset();
    fail_unstarted(rec, std::string("placement: ") + e.what());
    return;
  }
  log::info("job ", id, " starting on ", world, " ranks (", nodes_.size(), " nodes), placement epoch ",
            placement_epoch_);

  v1::Envelope req;
  auto* s = req.mutable_start_job();
  s->set_job_id(id);
  *s->mutable_spec() = job.spec;
  s->set_world_size(world);
  s->set_devices_per_node(devices_per_node_);
  for (const auto& m : maps_) *s->add_maps() = m;
  for (Node& n : nodes_) {
    n.busy_job = id;
    n.busy_ranks = devices_per_node_;
    const std::string address = n.control_address, name = n.name;
    outbound_->post([this, req, address, name, id] {
      std::optional<std::string> error;
      try {
        outbound_->client(address, opts_.token).call(req, opts_.daemon_call_timeout);
      } catch (const std::exception& e) {
        error = e.what();
      }
      if (error)
        rpc::asio::post(io_, [this, id, name, error] {
          if (running_ && running_->id == id && !running_->failed)
            fail_running("cannot start on node " + name + ": " + *error);
        });
    });
  }
}

void Agent::fail_unstarted(v1::JobResult& rec, const std::string& message) {
  rec.set_state(v1::JOB_STATE_FAILED);
  rec.set_message(message);
  rec.set_finished_unix_ms(unix_ms());
  job_event_.notify_all();
  rpc::asio::post(io_, [this] { try_schedule(); });
}

void Agent::cancel_daemons(const std::string& reason) {
  if (!running_) return;
  v1::Envelope req;
  req.mutable_cancel_job()->set_job_id(running_->id);
  req.mutable_cancel_job()->set_reason(reason);
  for (const Node& n : nodes_) {
    if (n.state != v1::NODE_STATE_ALIVE) continue;
    const std::string address = n.control_address;
    outbound_->post([this, req, address] {
      try {
        outbound_->client(address, opts_.token).call(req, opts_.daemon_call_timeout);
      } catch (const std::exception& e) {
        log::warn("cancel on ", address, ": ", e.what());
      }
    });
  }
}

void Agent::fail_running(const std::string& message) {
  if (!running_) return;
  running_->failed = true;
  running_->failed_at = Clock::now();
  running_->message = message;
  cancel_daemons(message);
  // A dead node never reports: end the job now rather than wait for every rank.
  bool any_dead = false;
  for (const Node& n : nodes_) any_dead |= n.state != v1::NODE_STATE_ALIVE;
  if (any_dead || running_->done_count == running_->world) finish(v1::JOB_STATE_FAILED, message);
}

void Agent::finish(v1::JobState state, const std::string& message) {
  Running& job = *running_;
  v1::JobResult& rec = jobs_.at(job.id);
  rec.set_state(state);
  rec.set_message(message);
  rec.set_finished_unix_ms(unix_ms());
  rec.set_placement_epoch(static_cast<double>(placement_epoch_));
  const int W = job.world;
  const int layers = job.spec.layers();
  std::vector<double> step_time, router, dispatch, expert, combine, backward, optimizer;
  double dbytes = 0, nbytes = 0, cbytes = 0;
  std::vector<std::vector<double>> expert_tokens(layers, std::vector<double>(job.spec.experts(), 0.0));
  std::vector<double> rank_tokens(W, 0.0);
  rec.clear_loss();
  for (const auto& [step, by_rank] : job.steps) {
    if (static_cast<int>(by_rank.size()) < W) continue;
    bool complete = true;
    for (const auto& s : by_rank) complete &= s.step() == step && s.step_seconds() > 0;
    if (!complete) continue;
    double t = 0, pr = 0, pd = 0, pe = 0, pc = 0, pb = 0, po = 0, loss = 0;
    for (int r = 0; r < W; ++r) {
      const v1::StepStats& s = by_rank[r];
      t = std::max(t, s.step_seconds());
      pr = std::max(pr, s.phase_seconds().router());
      pd = std::max(pd, s.phase_seconds().dispatch());
      pe = std::max(pe, s.phase_seconds().expert());
      pc = std::max(pc, s.phase_seconds().combine());
      pb = std::max(pb, s.phase_seconds().backward());
      po = std::max(po, s.phase_seconds().optimizer());
      dbytes += s.dispatch_bytes();
      nbytes += s.naive_dispatch_bytes();
      cbytes += s.combine_bytes();
      loss += s.loss();
      rank_tokens[r] += s.expert_rows();
      for (int l = 0; l < std::min(layers, s.expert_tokens_size()); ++l)
        for (int e = 0; e < std::min<int>(job.spec.experts(), s.expert_tokens(l).tokens_size()); ++e)
          expert_tokens[l][e] += s.expert_tokens(l).tokens(e);
    }
    step_time.push_back(t);
    router.push_back(pr);
    dispatch.push_back(pd);
    expert.push_back(pe);
    combine.push_back(pc);
    backward.push_back(pb);
    optimizer.push_back(po);
    if (job.spec.mode() == v1::JobSpec::train) rec.add_loss(loss);
  }
  rec.set_steps_completed(static_cast<double>(step_time.size()));
  const double p50 = median(step_time);
  rec.set_step_seconds_p50(p50);
  rec.set_tokens_per_second(p50 > 0 ? static_cast<double>(job.spec.tokens_per_rank()) * W / p50 : 0.0);
  auto* ph = rec.mutable_phase_seconds();
  ph->set_router(median(router));
  ph->set_dispatch(median(dispatch));
  const double expert_p50 = median(expert);
  ph->set_expert(expert_p50);
  ph->set_combine(median(combine));
  ph->set_backward(median(backward));
  ph->set_optimizer(median(optimizer));
  // Each step's expert phase is already its slowest rank's.
  rec.set_slowest_rank_expert_seconds(expert_p50);
  rec.set_dispatch_bytes(dbytes);
  rec.set_naive_dispatch_bytes(nbytes);
  rec.set_combine_bytes(cbytes);
  rec.clear_expert_tokens();
  for (const auto& layer : expert_tokens) *rec.add_expert_tokens()->mutable_tokens() = {layer.begin(), layer.end()};
  if (!step_time.empty()) last_loads_ = expert_tokens;
  *rec.mutable_rank_tokens() = {rank_tokens.begin(), rank_tokens.end()};
  const double max_rank = rank_tokens.empty() ? 0 : *std::max_element(rank_tokens.begin(), rank_tokens.end());
  double mean_rank = 0;
  for (double v : rank_tokens) mean_rank += v / std::max(1, W);
  rec.set_balancedness(max_rank > 0 ? mean_rank / max_rank : 0.0);
  if (job.spec.verify()) {
    v1::Verify v;
    v.set_passed(true);
    for (const auto& rv : job.verify) {
      v.set_max_abs_error(std::max(v.max_abs_error(), rv.max_abs_error()));
      v.set_max_rel_error(std::max(v.max_rel_error(), rv.max_rel_error()));
      v.set_passed(v.passed() && rv.passed());
    }
    if (state != v1::JOB_STATE_SUCCEEDED) v.set_passed(false);
    *rec.mutable_verify() = v;
  }
  log::info("job ", job.id, " ", v1::JobState_Name(state), message.empty() ? "" : ": " + message, " (",
            step_time.size(), " steps, ", static_cast<int64_t>(rec.tokens_per_second()), " tokens/s)");
  running_.reset();
  job_event_.notify_all();
  bootstrap_event_.notify_all();
  rpc::asio::post(io_, [this] { try_schedule(); });
}

}  // namespace moe::agent
