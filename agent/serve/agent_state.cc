// The agent's state directory (docs/placement.md#agent-persistence): what is
// written when, and how a restarted agent reads it back. Written on every
// membership change, job state change and map or epoch change, and at most once
// a second while steps arrive (their load windows move every step).
#include <chrono>
#include <thread>

#include "moe/agent/agent.h"
#include "moe/base/clock.h"
#include "moe/base/log.h"

namespace moe::agent {

namespace {

constexpr auto kStepPersistInterval = std::chrono::seconds(1);
constexpr auto kRebindPatience = std::chrono::seconds(10);

// The state with its running job failed and its nodes dropped: a new cluster.
void forget_nodes(v1::AgentState& state) {
  v1::SchedulerState& s = *state.mutable_scheduler();
  const std::string running = s.running().job_id();
  for (v1::JobResult& rec : *s.mutable_jobs()) {
    if (rec.job_id() != running) continue;
    rec.set_state(v1::JOB_STATE_FAILED);
    rec.set_message("agent restarted: started as a new cluster (--forget-nodes)");
    rec.set_finished_unix_ms(unix_ms());
    log::warn("job ", running, ": ", rec.message());
  }
  s.clear_running();
  state.clear_membership();
}

}  // namespace

std::optional<v1::AgentState> Agent::load_state() {
  if (opts_.state_dir.empty()) {
    incarnation_ = static_cast<int64_t>(unix_ms());
    return std::nullopt;
  }
  store_ = std::make_unique<StateStore>(opts_.state_dir);
  std::optional<v1::AgentState> saved = store_->load();
  if (!saved) {
    incarnation_ = static_cast<int64_t>(unix_ms());
    log::info("state dir ", opts_.state_dir, ": no state yet, starting fresh");
    return saved;
  }
  incarnation_ = saved->incarnation() + 1;
  if (opts_.forget_nodes) forget_nodes(*saved);
  const auto now = Clock::now();
  try {
    members_.restore(saved->membership(), now);
    placement_.restore(saved->placement());
    scheduler_.restore(saved->scheduler(), now);
    // Ranks bootstrapping the running job's world publish again to this incarnation.
    if (const RunningJob* job = scheduler_.running()) relay_.begin(job->id, job->reports.world, job->world_epoch);
  } catch (const moe::Error& e) {
    throw StateFileError("agent state file " + store_->file().string() + ": " + e.what());
  }
  log::info("state dir ", opts_.state_dir, ": read back ", members_.num_nodes(), " node(s), ",
            scheduler_.jobs().size(), " job(s), placement epoch ", placement_.epoch(), "; incarnation ", incarnation_);
  return saved;
}

// Serves on `address`. A fixed port may be held for a moment by another socket
// (a client's connection that happens to come from it); wait for it rather than
// give up an address the daemons dial.
std::unique_ptr<rpc::RpcServer> Agent::listen_on(const std::string& address, const rpc::Handler& handler) {
  const auto give_up = std::chrono::steady_clock::now() + kRebindPatience;
  for (bool told = false;; told = true) {
    try {
      return std::make_unique<rpc::RpcServer>(io_, rpc::ServerOptions::make(address, opts_.token, "moe-agent", opts_.tls), handler);
    } catch (const boost::system::system_error& e) {
      const bool in_use = e.code() == boost::asio::error::address_in_use;
      if (!in_use || rpc::split_address(address).second == 0 || std::chrono::steady_clock::now() >= give_up) throw;
      if (!told) log::warn(address, " is in use; waiting up to ", kRebindPatience.count(), " s for it");
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
}

// --listen, or with port 0 the address of the previous run, which the daemons
// dial. A new cluster (--forget-nodes) takes any port if that one stays taken.
void Agent::serve(const std::optional<v1::AgentState>& saved) {
  const rpc::Handler handler = [this](const v1::Envelope& req, const rpc::RequestContext& ctx) {
    return handle(req, ctx);
  };
  const auto [host, port] = rpc::split_address(opts_.listen);
  if (port != 0 || !saved || saved->address().empty()) {
    server_ = listen_on(opts_.listen, handler);
    return;
  }
  const std::string previous = host + ":" + std::to_string(rpc::split_address(saved->address()).second);
  try {
    server_ = listen_on(previous, handler);
  } catch (const std::exception& e) {
    const std::string why = "cannot bind " + previous + ", the address of the previous run (" +
                            store_->file().string() + "): " + e.what();
    if (!opts_.forget_nodes) throw moe::Error(why + "; the daemons look for the agent there");
    log::warn(why, "; a new cluster takes another port");
    server_ = listen_on(opts_.listen, handler);
  }
}

v1::AgentState Agent::snapshot() const {
  v1::AgentState s;
  s.set_address(server_->address());
  s.set_incarnation(incarnation_);
  *s.mutable_membership() = members_.state();
  *s.mutable_placement() = placement_.state();
  *s.mutable_scheduler() = scheduler_.state();
  return s;
}

void Agent::persist() {
  if (!store_ || stopped_) return;
  persist_pending_ = false;
  last_persist_ = Clock::now();
  try {
    store_->save(snapshot());
    if (!persist_error_.empty()) log::info("state dir: written again");
    persist_error_.clear();
  } catch (const std::exception& e) {
    if (persist_error_ != e.what()) log::error("state dir: ", e.what());
    if (persist_error_.empty()) persist_error_since_ = unix_ms();
    persist_error_ = e.what();
  }
}

void Agent::persist_soon() {
  if (!store_ || stopped_ || persist_pending_) return;
  persist_pending_ = true;
  persist_timer_.expires_at(last_persist_ + kStepPersistInterval);
  persist_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (!ec && persist_pending_) persist();
  });
}

v1::Envelope Agent::report_ack(const std::string& job_id) const {
  v1::Envelope reply;
  v1::ReportAck* ack = reply.mutable_report_ack();
  ack->set_agent_incarnation(incarnation_);
  const auto it = scheduler_.jobs().find(job_id);
  ack->set_job_ended(it == scheduler_.jobs().end() || Scheduler::finished(it->second.state()));
  return reply;
}

}  // namespace moe::agent
