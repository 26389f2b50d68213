#include "moe/jobs/job_lifecycle.h"

#include "moe/spec/checkpoint_manifest.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "moe/base/check.h"
#include "moe/base/clock.h"
#include "moe/base/log.h"
#include "moe/base/random.h"
#include "moe/rpc/frame.h"
#include "moe/spec/job_spec.h"

namespace moe::agent {

using rpc::RpcError;

JobLifecycle::JobLifecycle(const SchedulerOptions& opts, Membership& members, PlacementService& placement,
                           SchedulerActions& actions, JobBook& book)
    : opts_(opts), members_(members), placement_(placement), actions_(actions), book_(book) {}

namespace {

double median_of(std::deque<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The slowest rank's time of a complete step into the job's recent window; a
// world's first step, the newest entry until then, leaves it when the next
// arrives (RunningJob). After an elastic world change the window still holds the
// old world's steps, older than it.
void push_recent_step(RunningJob& job, double seconds) {
  std::deque<double>& window = job.recent_step_seconds;
  if (job.warmup_in_window && !window.empty()) window.pop_back();
  window.push_back(seconds);
  if (window.size() > RunningJob::kRecentSteps) window.pop_front();
  job.warmup_in_window = job.next_step_warms_up;
  job.next_step_warms_up = false;
}

}  // namespace

void JobLifecycle::cancel(Clock::time_point now) {
  if (!running_ || running_->ending()) return;
  running_->cancelled = true;
  running_->reason_known = true;
  running_->failed_at = now;
  running_->message = "cancelled";
  log::info("job ", running_->id, ": cancelling");
  actions_.cancel_job(running_->id, "cancelled by request", false);
}

// The job's data-plane key (docs/transport.md#job-key): 32 bytes of the kernel's CSPRNG.
std::string new_data_plane_key() { return random_bytes(32); }

// QUEUED -> RUNNING, or -> FAILED when the cluster cannot run the spec.
bool JobLifecycle::start(v1::JobResult& rec, Clock::time_point now) {
  const int world = members_.world_size();
  if (const std::string mismatch = members_.backend_mismatch(); !mismatch.empty()) {
    fail_unstarted(rec, mismatch);
    return false;
  }
  v1::StartJob msg;
  try {
    spec::validate(rec.spec(), world);
    for (v1::PlacementMap& m : job_maps(rec)) *msg.add_maps() = std::move(m);
  } catch (const moe::Error& e) {  // names the field, the checkpoint's file or the placement rule
    fail_unstarted(rec, e.what());
    return false;
  }
  running_ = std::make_unique<RunningJob>();
  running_->id = rec.job_id();
  running_->shape = {rec.spec().experts(), rec.spec().layers(), members_.num_nodes(), members_.devices_per_node()};
  running_->reports.spec = rec.spec();
  running_->reports.world = world;
  running_->reports.verify.assign(world, {});
  running_->done.assign(world, false);
  running_->last_report = now;
  for (int n = 0; n < members_.num_nodes(); ++n) running_->nodes.push_back(n);
  rec.set_state(v1::JOB_STATE_RUNNING);
  rec.set_started_unix_ms(unix_ms());
  rec.mutable_progress()->set_steps(rec.spec().steps());
  rec.mutable_progress()->set_updated_unix_ms(unix_ms());
  for (const auto& m : msg.maps()) rec.set_placement_epoch(std::max(rec.placement_epoch(), static_cast<double>(m.epoch())));
  members_.mark_busy(rec.job_id());
  log::info("job ", rec.job_id(), " starting on ", world, " ranks (", members_.num_nodes(), " nodes), placement epoch ",
            placement_.epoch());
  msg.set_job_id(rec.job_id());
  *msg.mutable_spec() = rec.spec();
  msg.set_world_size(world);
  msg.set_devices_per_node(members_.devices_per_node());
  msg.set_data_plane_key(new_data_plane_key());
  actions_.start_job(msg);
  return true;
}

// The maps a job starts on: its shape's current maps, or a resumed job's from its
// checkpoint (docs/jobs.md#checkpoints-and-resume), whose folder is resolved to
// its step folder (the daemons are then told it) and whose files and spec are
// checked first. A solver error is named "placement: ...".
std::vector<v1::PlacementMap> JobLifecycle::job_maps(v1::JobResult& rec) {
  v1::JobSpec& spec = *rec.mutable_spec();
  const ShapeKey shape{spec.experts(), spec.layers(), members_.num_nodes(), members_.devices_per_node()};
  std::optional<v1::CheckpointManifest> ck;
  if (!spec.resume().empty()) {
    std::string folder;
    ck = spec::load_for_resume(spec, folder);
    spec.set_resume(folder);
  }
  try {
    auto maps = ck ? placement_.maps_for_resume(spec, shape, *ck, rec.job_id())
                   : placement_.maps_for_job(spec, shape, rec.job_id() + "'s start");
    rec.set_placement(placement_.summary(shape));
    return maps;
  } catch (const RpcError&) {
    throw;  // names its rule already
  } catch (const moe::Error& e) {
    detail::fail("placement: ", e.what());
  }
}

void JobLifecycle::fail_unstarted(v1::JobResult& rec, const std::string& message) {
  rec.set_state(v1::JOB_STATE_FAILED);
  rec.set_message(message);
  rec.set_finished_unix_ms(unix_ms());
  log::warn("job ", rec.job_id(), " cannot start: ", message);
  actions_.job_ended(rec);
}

std::optional<int> JobLifecycle::on_step(const v1::StepReport& r, Clock::time_point now) {
  if (!running_ || running_->id != r.job_id()) return std::nullopt;
  if (r.stats().world_epoch() != running_->world_epoch) {
    if (on_past_world_step(r)) heard_from(-1, now);
    return std::nullopt;
  }
  if (r.rank() < 0 || r.rank() >= running_->reports.world) return std::nullopt;
  auto& by_rank = running_->reports.steps[r.stats().step()];
  by_rank.resize(running_->reports.world);
  by_rank[r.rank()] = r.stats();  // a re-sent report replaces its first copy
  heard_from(r.rank(), now);
  const bool all = std::all_of(by_rank.begin(), by_rank.end(), [](const v1::StepStats& s) { return s.step_seconds() > 0; });
  if (!all) return std::nullopt;
  // progress shows in `job status` while it runs
  v1::JobResult& rec = book_.at(r.job_id());
  rec.set_steps_completed(std::max(rec.steps_completed(), static_cast<double>(r.stats().step() + 1)));
  // Steps complete in order (each rank reports in order); a re-sent one, after
  // a failed call or an agent restart, is in the window already.
  if (r.stats().step() < running_->steps_recorded) return std::nullopt;
  running_->steps_recorded = r.stats().step() + 1;
  double slowest = 0;
  for (const v1::StepStats& s : by_rank) slowest = std::max(slowest, s.step_seconds());
  push_recent_step(*running_, slowest);
  const bool serving = running_->reports.spec.mode() == v1::JobSpec::serve;
  if (!serving || has_rows(by_rank)) record_load(by_rank);  // an idle window measured no load
  update_progress(rec, by_rank, now);
  if (serving) {  // a serving job runs for days: its result keeps the recent windows
    auto& steps = running_->reports.steps;
    steps.erase(steps.begin(), steps.lower_bound(r.stats().step() - kServeWindowsKept));
  }
  return r.stats().step();
}

// The running job's progress from its newest complete step; the result's
// measured fields too, at most once a second (fill_result reads every step).
void JobLifecycle::update_progress(v1::JobResult& rec, const std::vector<v1::StepStats>& by_rank, Clock::time_point now) {
  const RunningJob& job = *running_;
  const v1::JobSpec& spec = job.reports.spec;
  v1::JobProgress& p = *rec.mutable_progress();
  const int step = by_rank[0].step() + 1;
  p.set_step(step);
  p.set_steps(spec.steps());
  double loss = 0;
  int64_t epoch = 0;
  for (const v1::StepStats& s : by_rank) {
    loss += s.loss();
    for (int64_t e : s.layer_epoch()) epoch = std::max(epoch, e);
  }
  if (by_rank[0].has_job_loss()) loss = by_rank[0].job_loss();  // the ranks' own sum, in rank order
  if (spec.mode() == v1::JobSpec::train) p.set_loss(loss);
  p.set_epoch(epoch);
  const double step_seconds = median_of(job.recent_step_seconds);
  p.set_step_seconds(step_seconds);
  p.set_recent_steps(static_cast<int32_t>(job.recent_step_seconds.size()));
  p.set_tokens_per_second(step_seconds > 0 ? static_cast<double>(spec.tokens_per_rank()) * job.reports.world / step_seconds
                                           : 0.0);
  p.set_eta_seconds(std::max(0, spec.steps() - step) * step_seconds);
  if (spec.mode() == v1::JobSpec::serve) {  // windows, not steps (docs/serving.md#statistics)
    *p.mutable_serve() = serve_progress(by_rank);
    p.set_tokens_per_second(p.serve().rows_per_second());
    p.clear_eta_seconds();
  }
  p.set_updated_unix_ms(unix_ms());
  if (now - job.last_fill < std::chrono::seconds(1) && step < spec.steps()) return;
  running_->last_fill = now;
  v1::JobProgress kept = p;
  fill_result(job.reports, v1::JOB_STATE_RUNNING, rec);
  *rec.mutable_progress() = kept;
  const v1::PlacementReply window = placement_.describe(job.shape, std::nullopt);
  double sum = 0;
  int layers = 0;
  for (const v1::LayerPlacement& l : window.layers())
    if (l.rank_window_steps() > 0) sum += l.balancedness(), ++layers;
  if (layers > 0) rec.mutable_progress()->set_window_balancedness(sum / layers);
  else rec.mutable_progress()->clear_window_balancedness();
}

// A serving window in which some rank computed rows.
bool JobLifecycle::has_rows(const std::vector<v1::StepStats>& by_rank) {
  for (const v1::StepStats& s : by_rank)
    for (double n : s.serve().layer_rows())
      if (n > 0) return true;
  return false;
}

// A complete step's measured load into the placement window
// (docs/placement.md#load-and-balancedness).
void JobLifecycle::record_load(const std::vector<v1::StepStats>& by_rank) {
  const int L = running_->reports.spec.layers(), E = running_->reports.spec.experts(), W = running_->reports.world;
  std::vector<std::vector<double>> expert(L, std::vector<double>(E, 0.0)), rank(L, std::vector<double>(W, 0.0));
  std::vector<int64_t> epochs(L, 0);
  for (int r = 0; r < W; ++r) {
    const v1::StepStats& s = by_rank[r];
    for (int l = 0; l < std::min(L, s.expert_tokens_size()); ++l)
      for (int e = 0; e < std::min(E, s.expert_tokens(l).tokens_size()); ++e) expert[l][e] += s.expert_tokens(l).tokens(e);
    for (int l = 0; l < std::min(L, s.layer_pairs_size()); ++l) rank[l][r] = s.layer_pairs(l);
    for (int l = 0; l < std::min(L, s.layer_epoch_size()); ++l) epochs[l] = std::max(epochs[l], s.layer_epoch(l));
  }
  placement_.record_step(running_->shape, expert, rank, epochs);
}

void JobLifecycle::on_activity(const std::string& job_id, Clock::time_point now) {
  if (running_ && running_->id == job_id) running_->last_report = now;
}

// A rank stopped because the job was cancelled. The reason is the one from the
// rank whose daemon was asked, whichever rank's report arrives first.
void JobLifecycle::note_cancelled_rank(const v1::RankDone& d, Clock::time_point now) {
  RunningJob& job = *running_;
  if (job.failed || (job.cancelled && (!d.cancel_requested_here() || job.reason_known))) return;
  if (!job.cancelled) job.failed_at = now;
  job.cancelled = true;
  job.reason_known = d.cancel_requested_here();
  job.message = describe_rank(d.rank()) + ": " + d.message();
}

void JobLifecycle::on_rank_done(const v1::RankDone& d, Clock::time_point now) {
  if (!running_ || running_->id != d.job_id() || d.rank() < 0 || d.rank() >= running_->reports.world) return;
  if (d.world_epoch() != running_->world_epoch) return;  // a rank fenced out of an elastic job's world
  RunningJob& job = *running_;
  if (!job.done[d.rank()]) {
    job.done[d.rank()] = true;
    ++job.done_count;
  }
  job.reports.verify[d.rank()] = d.verify();
  heard_from(d.rank(), now);
  if (!d.ok() && d.agent_unreachable() && !job.failed) {
    // Its daemon stopped the job: the agent was away longer than its grace. The
    // peers it stopped may have reported first, as "cancelled by another rank".
    job.cancelled = false;
    log::warn("job ", job.id, ": ", describe_rank(d.rank()), " stopped without the agent: ", d.message());
    return fail_running((job.restored ? "agent restarted: " : "") + describe_rank(d.rank()) + ": " + d.message(),
                        now);
  }
  if (!d.ok() && d.cancelled()) note_cancelled_rank(d, now);
  if (!d.ok() && !d.cancelled() && !job.ending()) {
    log::warn("job ", job.id, ": ", describe_rank(d.rank()), " failed: ", d.message());
    // Name the rank (and node) the error blames when the reporter knows it.
    if (d.has_failed_peer() && d.failed_peer() >= 0 && d.failed_peer() != d.rank())
      fail_running(describe_rank(d.failed_peer()) + " failed (reported by " +
                       describe_rank(d.rank()) + "): " + d.message(),
                   now);
    else
      fail_running(describe_rank(d.rank()) + ": " + d.message(), now);
    return;
  }
  finish_if_all_done();
}

void JobLifecycle::finish_if_all_done() {
  const RunningJob& job = *running_;
  if (job.done_count < job.reports.world) return;
  if (job.cancelled) finish(v1::JOB_STATE_CANCELLED, job.message);
  else if (job.failed) finish(v1::JOB_STATE_FAILED, job.message);
  else finish(v1::JOB_STATE_SUCCEEDED, "");
}

void JobLifecycle::on_start_failed(const std::string& job_id, const std::string& node, const std::string& error,
                                Clock::time_point now) {
  if (running_ && running_->id == job_id && !running_->failed)
    fail_running("cannot start on node " + node + ": " + error, now);
}

void JobLifecycle::on_node_dead(const std::string& why, Clock::time_point now) {
  if (!running_) return;
  if (running_->cancelled) return finish(v1::JOB_STATE_FAILED, running_->message + "; " + why);  // it will never report
  const std::string lost = node_lost_message(why);
  if (!running_->ending()) fail_running(lost, now);
  else finish(v1::JOB_STATE_FAILED, lost);
}

// The loss of a node ends a job that is not elastic: the message leads with the
// node and what to do; the survivors' transport errors (in UCX's or NCCL's
// words), when they came first, follow as what the ranks saw.
std::string JobLifecycle::node_lost_message(const std::string& why) const {
  std::string m = after_restart(why) + " after " + std::to_string(running_->steps_recorded) +
                  " complete steps; a job that is not elastic fails with its node (--elastic with "
                  "--min-node-replicas 2 goes on without it: docs/jobs.md#elastic-jobs)";
  if (running_->failed && !running_->message.empty()) m += "; the other ranks saw: " + running_->message;
  return m;
}

void JobLifecycle::tick(Clock::time_point now) {
  if (!running_) return;
  if (running_->ending() && now - running_->failed_at > opts_.failed_job_grace)
    finish(running_->failed ? v1::JOB_STATE_FAILED : v1::JOB_STATE_CANCELLED,
           running_->message + " (not every rank reported back)");
  else if (!running_->ending() && running_->reports.spec.mode() != v1::JobSpec::serve &&
           now - running_->last_report > opts_.stale_job_timeout)  // a serving job reports no steps
    fail_running("no rank reported for " +
                     std::to_string(std::chrono::duration_cast<std::chrono::seconds>(opts_.stale_job_timeout).count()) +
                     " s",
                 now);
  // A serving job's ranks report nothing until it ends: its daemons' heartbeats
  // and registrations tell whether it still runs.
  else if (!running_->ending() && running_->awaiting_ranks() && running_->reports.spec.mode() != v1::JobSpec::serve &&
           now - running_->restored_at > opts_.restored_job_timeout) {
    const int rank = static_cast<int>(std::find(running_->heard.begin(), running_->heard.end(), false) - running_->heard.begin());
    fail_running("agent restarted: " + describe_rank(rank) + " did not report within " +
                     std::to_string(std::chrono::duration_cast<std::chrono::seconds>(opts_.restored_job_timeout).count()) +
                     " s",
                 now);
  }
}

// RUNNING -> failing: the daemons are told to stop; the job ends when every rank
// reported, at once if a node is dead (it never will), or after the grace.
void JobLifecycle::fail_running(const std::string& message, Clock::time_point now) {
  if (!running_) return;
  running_->failed = true;
  running_->failed_at = now;
  running_->message = message;
  actions_.cancel_job(running_->id, message, true);
  if (members_.any_dead() || running_->done_count == running_->reports.world) finish(v1::JOB_STATE_FAILED, message);
}

// RUNNING -> a final state, with the result built from the step reports.
void JobLifecycle::finish(v1::JobState state, const std::string& message) {
  const std::unique_ptr<RunningJob> job = std::move(running_);
  v1::JobResult& rec = book_.at(job->id);
  rec.set_state(state);
  rec.set_message(message);
  rec.set_finished_unix_ms(unix_ms());
  fill_result(job->reports, state, rec);
  log::info("job ", job->id, " ", v1::JobState_Name(state), message.empty() ? "" : ": " + message, " (",
            rec.steps_completed(), " steps, ", static_cast<int64_t>(rec.tokens_per_second()), " tokens/s)");
  actions_.job_ended(rec);
}

bool JobLifecycle::elastic_running() const {
  return running_ && running_->reports.spec.elastic() && !running_->ending();
}

bool RunningJob::awaiting_ranks() const {
  return restored && std::find(heard.begin(), heard.end(), false) != heard.end();
}

std::string JobLifecycle::after_restart(const std::string& why) const {
  return running_ && running_->awaiting_ranks() ? "agent restarted: " + why : why;
}

void JobLifecycle::heard_from(int rank, Clock::time_point now) {
  running_->last_report = now;
  if (running_->restored && rank >= 0 && rank < static_cast<int>(running_->heard.size())) running_->heard[rank] = true;
}

bool JobLifecycle::mark_done(int from, int to) {
  RunningJob& job = *running_;
  for (int r = from; r < to && r < job.reports.world; ++r)
    if (!job.done[r]) {
      job.done[r] = true;
      ++job.done_count;
    }
  return job.done_count == job.reports.world;
}

// A node of the running job registered again without it: the daemon restarted
// (or, after an agent restart, lost the job). Its ranks' part ended with the old
// process and they will never report: they count as done, the job fails at once
// and the survivors abort their transports.
void JobLifecycle::node_restarted(const NodeRecord& node, const std::string& running_job, Clock::time_point now) {
  RunningJob& job = *running_;
  const int D = members_.devices_per_node();
  const bool all_done = mark_done(node.index * D, (node.index + 1) * D);
  if (job.ending()) {
    if (all_done) finish(job.failed ? v1::JOB_STATE_FAILED : v1::JOB_STATE_CANCELLED, job.message);
    return;
  }
  const std::string came_back =
      members_.describe_node(node) + " came back " + (running_job.empty() ? "running no job" : "running " + running_job);
  fail_running(job.awaiting_ranks() ? "agent restarted: " + came_back
                                    : members_.describe_node(node) + " restarted during the job (its ranks' state is lost)",
               now);
}

void JobLifecycle::move_to_world(const v1::NewWorld& w, const ShapeKey& shape) {
  RunningJob& job = *running_;
  job.shape = shape;
  job.reports.spec.set_tokens_per_rank(w.tokens_per_rank());
  job.reports.world = w.world_size();
  job.reports.verify.assign(w.world_size(), {});
  job.done.assign(w.world_size(), false);
  job.done_count = 0;
  job.reports.steps.erase(job.reports.steps.lower_bound(w.resume_step()), job.reports.steps.end());
  for (const auto& [step, by_rank] : job.reports.steps) job.reports.whole.insert(step);
  job.steps_recorded = w.resume_step();
  job.next_step_warms_up = true;
  book_.at(job.id).set_steps_completed(w.resume_step());
  job.restored = false;  // this agent decided the world: its ranks answer to it
}

int JobLifecycle::home_rank(int rank, int64_t epoch) const {
  if (!running_ || rank < 0) return rank;
  const int D = members_.devices_per_node();
  const std::vector<int>* nodes = &running_->nodes;
  if (epoch != running_->world_epoch) {
    const auto it = running_->past_worlds.find(epoch);
    if (it == running_->past_worlds.end()) return rank;
    nodes = &it->second.nodes;
  }
  const size_t pos = static_cast<size_t>(rank / D);
  return pos < nodes->size() ? (*nodes)[pos] * D + rank % D : rank;
}

std::string JobLifecycle::describe_rank(int rank) const {
  if (!running_ || running_->world_epoch == 0) return members_.describe_rank(rank);
  const int D = members_.devices_per_node();
  const size_t pos = static_cast<size_t>(rank / D);
  if (rank < 0 || pos >= running_->nodes.size()) return "rank " + std::to_string(rank);
  return "rank " + std::to_string(rank) + " (node " + members_.nodes()[running_->nodes[pos]].name + ")";
}

// A report from an earlier world: a survivor's step it applied on its way to
// the new world (kept beside the step's other reports), or a step that will run
// again (dropped). True when kept.
bool JobLifecycle::on_past_world_step(const v1::StepReport& r) {
  const auto past = running_->past_worlds.find(r.stats().world_epoch());
  if (past == running_->past_worlds.end() || r.stats().step() >= past->second.next_step) return false;
  const int world = static_cast<int>(past->second.nodes.size()) * members_.devices_per_node();
  if (r.rank() < 0 || r.rank() >= world) return false;
  auto& by_rank = running_->reports.steps[r.stats().step()];
  by_rank.resize(std::max<size_t>(by_rank.size(), world));
  by_rank[r.rank()] = r.stats();
  running_->reports.whole.insert(r.stats().step());
  return true;
}

void JobLifecycle::save(v1::SchedulerState& s) const {
  if (!running_) return;
  v1::RunningJobState* r = s.mutable_running();
  r->set_job_id(running_->id);
  *r->mutable_shape() = running_->shape.proto();
  r->set_world_size(running_->reports.world);
  r->set_world_epoch(running_->world_epoch);
  for (int n : running_->nodes) r->add_nodes(n);
  r->set_tokens_per_rank(running_->reports.spec.tokens_per_rank());
  r->set_warmup_pending(running_->next_step_warms_up);
  for (const auto& [epoch, past] : running_->past_worlds) {
    v1::PastWorldState* p = r->add_past_worlds();
    p->set_world_epoch(epoch);
    for (int n : past.nodes) p->add_nodes(n);
    p->set_next_step(past.next_step);
  }
}

}  // namespace moe::agent
