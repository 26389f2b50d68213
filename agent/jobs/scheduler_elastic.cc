// The scheduler's side of elastic jobs (docs/jobs.md#elastic-jobs): a lost node,
// or a rank whose world failed, halts the job's world; once every surviving rank
// said what it applied, the agent decides the new world (world_change.h), places
// the experts on it and moves the survivors there.
#include <algorithm>

#include "moe/jobs/scheduler.h"
#include "moe/jobs/world_change.h"
#include "moe/base/check.h"
#include "moe/base/clock.h"
#include "moe/base/log.h"
#include "moe/spec/checkpoint_manifest.h"

namespace moe::agent {
namespace {

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The checkpoint an elastic job rolls back to when experts are lost with no
// surviving copy: its checkpoint_dir's latest complete one. Throws moe::Error
// with `lost` when it has none.
std::string rollback_checkpoint(const v1::JobSpec& spec, const std::string& lost) {
  if (spec.checkpoint_dir().empty())
    detail::fail(lost, "; no checkpoint to roll back to (give --checkpoint-dir and --checkpoint-every, or "
                       "--min-node-replicas 2)");
  try {
    return spec::resolve_checkpoint(spec.checkpoint_dir());
  } catch (const moe::Error& e) {
    detail::fail(lost, "; no checkpoint to roll back to (", e.what(), ")");
  }
}

}  // namespace

bool Scheduler::elastic_running() const {
  return running_ && running_->reports.spec.elastic() && !running_->ending();
}

int Scheduler::home_rank(int rank, int64_t epoch) const {
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

std::string Scheduler::describe_rank(int rank) const {
  if (!running_ || running_->world_epoch == 0) return members_.describe_rank(rank);
  const int D = members_.devices_per_node();
  const size_t pos = static_cast<size_t>(rank / D);
  if (rank < 0 || pos >= running_->nodes.size()) return "rank " + std::to_string(rank);
  return "rank " + std::to_string(rank) + " (node " + members_.nodes()[running_->nodes[pos]].name + ")";
}

void Scheduler::node_lost(int node, const std::string& kind, const std::string& why, Clock::time_point now) {
  RunningJob& job = *running_;
  const auto pos = std::find(job.nodes.begin(), job.nodes.end(), node);
  if (pos == job.nodes.end()) return;  // not in this world
  if (job.past_last_step()) {
    // Every step is complete: nothing to go on with. The node's ranks count as
    // done (their RankDones may never come); the job ends with the others'.
    log::warn("job ", job.id, ": ", why, " after its last step");
    const int D = members_.devices_per_node();
    for (int r = static_cast<int>(pos - job.nodes.begin()) * D, end = r + D; r < end; ++r)
      if (!job.done[r]) job.done[r] = true, ++job.done_count;
    if (job.done_count == job.reports.world) finish(v1::JOB_STATE_SUCCEEDED, "");
    return;
  }
  if (!job.halt) return begin_halt(kind, why, {node}, now);
  if (!job.halt->lost.insert(node).second) return;
  job.halt->detection_seconds =
      std::max(job.halt->detection_seconds, seconds(job.halt->started - members_.nodes()[node].last_heartbeat));
  log::warn("job ", job.id, ": ", why, ": it leaves the job's world");
  try_new_world(now);
}

// A node outside the job's world registered idle: the world halts at once
// (the step in flight is abandoned or rolled forward, as for a loss) and the
// new one takes it in.
void Scheduler::node_joins(const NodeRecord& node, Clock::time_point now) {
  RunningJob& job = *running_;
  if (job.halt) {
    job.halt->joining.insert(node.index);
    return try_new_world(now);
  }
  job.halt = RunningJob::Halt{.kind = "node_joined",
                              .cause = members_.describe_node(node) + " registered: it joins the job",
                              .lost = {},
                              .joining = {node.index},
                              .halted = {},
                              .started = now};
  log::info("job ", job.id, ": world ", job.world_epoch, " halts: ", job.halt->cause);
  actions_.halt_world(job.id, job.world_epoch, job.halt->cause, job.nodes);
}

void Scheduler::on_node_idle(const NodeRecord& node, Clock::time_point now) {
  if (elastic_running() && node.state == v1::NODE_STATE_ALIVE &&
      std::find(running_->nodes.begin(), running_->nodes.end(), node.index) == running_->nodes.end())
    node_joins(node, now);
}

void Scheduler::on_rank_halted(const v1::RankHalted& h, Clock::time_point now) {
  if (!elastic_running() || running_->id != h.job_id() || h.world_epoch() != running_->world_epoch) return;
  if (running_->past_last_step()) return;  // its end is near
  if (h.rank() < 0 || h.rank() >= running_->reports.world) return;
  heard_from(h.rank(), now);
  if (!running_->halt) {
    const bool blames = h.has_failed_peer() && h.failed_peer() >= 0 && h.failed_peer() != h.rank();
    begin_halt("peer_failed", blames ? describe_rank(h.failed_peer()) + " failed (reported by " + describe_rank(h.rank()) +
                            "): " + h.message()
                      : describe_rank(h.rank()) + ": " + h.message(),
               {}, now);
  }
  running_->halt->halted[h.rank()] = h;
  try_new_world(now);
}

void Scheduler::on_halt_failed(const std::string& job_id, int64_t epoch, int node, const std::string& error,
                               Clock::time_point now) {
  if (!elastic_running() || running_->id != job_id || epoch != running_->world_epoch || !running_->halt) return;
  node_lost(node, "peer_failed", members_.describe_node(members_.nodes()[node]) + " cannot be reached (" + error + ")",
            now);
}

// Every node of the world stops it; a node already known lost is not asked.
void Scheduler::begin_halt(const std::string& kind, const std::string& cause, std::set<int> lost,
                           Clock::time_point now) {
  RunningJob& job = *running_;
  job.halt = RunningJob::Halt{
      .kind = kind, .cause = cause, .lost = std::move(lost), .joining = {}, .halted = {}, .started = now};
  for (int n : job.halt->lost)
    job.halt->detection_seconds = std::max(job.halt->detection_seconds, seconds(now - members_.nodes()[n].last_heartbeat));
  log::warn("job ", job.id, ": world ", job.world_epoch, " halts: ", cause);
  std::vector<int> told;
  for (int n : job.nodes)
    if (!job.halt->lost.count(n)) told.push_back(n);
  actions_.halt_world(job.id, job.world_epoch, cause, told);
  try_new_world(now);
}

// Every node of the halted world is lost or has all of its ranks' reports.
bool Scheduler::halt_complete() const {
  const RunningJob& job = *running_;
  const int D = members_.devices_per_node();
  for (size_t pos = 0; pos < job.nodes.size(); ++pos) {
    if (job.halt->lost.count(job.nodes[pos])) continue;
    for (int d = 0; d < D; ++d)
      if (!job.halt->halted.count(static_cast<int>(pos) * D + d)) return false;
  }
  return true;
}

// Once the halt is complete: the new world decided, recorded and sent; or the
// job failed naming why it cannot go on.
void Scheduler::try_new_world(Clock::time_point now) {
  if (!halt_complete()) return;
  DecidedWorld next;
  try {
    next = decide_world();
  } catch (const moe::Error& e) {
    return fail_running("elastic: " + std::string(e.what()) + " (world " + std::to_string(running_->world_epoch) +
                            " halted: " + running_->halt->cause + ")",
                        now);
  }
  record_change(next);
  enter_world(next);
}

// The new world (world_change.h) with its maps and expert moves; when an expert
// has no surviving copy, a rollback to the job's latest checkpoint instead.
// Throws moe::Error naming what cannot go on.
Scheduler::DecidedWorld Scheduler::decide_world() {
  RunningJob& job = *running_;
  const RunningJob::Halt& h = *job.halt;
  WorldChangeInput in{.spec = job.reports.spec,
                      .devices_per_node = members_.devices_per_node(),
                      .tokens_per_rank = job.reports.spec.tokens_per_rank(),
                      .nodes = job.nodes,
                      .lost = h.lost,
                      .joining = h.joining,
                      .halted = h.halted,
                      .old_maps = {},
                      .node_names = {}};
  in.old_maps = placement_.maps(job.shape);
  for (const NodeRecord& n : members_.nodes()) in.node_names.push_back(n.name);
  WorldChangePlan plan = plan_world(in);
  DecidedWorld d{.world = {}, .nodes = plan.nodes, .shape = job.shape, .steps_recomputed = 0, .from_checkpoint = 0};
  d.shape.nodes = static_cast<int>(plan.nodes.size());
  const std::vector<v1::PlacementMap> maps = placement_.maps_for_world(job.reports.spec, job.shape, d.shape);
  std::vector<v1::ExpertMove> moves;
  try {
    moves = expert_moves(in, plan, maps);
  } catch (const moe::Error& lost) {
    const std::string folder = rollback_checkpoint(job.reports.spec, lost.what());
    const v1::CheckpointManifest m = spec::read_manifest(folder);
    spec::check_files(folder, m);
    plan.steps_recomputed = plan.world.resume_step() - m.step();
    plan.world.set_resume_step(m.step());
    plan.world.set_rollback(folder);
    d.from_checkpoint = lost_experts(in, plan);
    log::warn("job ", job.id, ": ", lost.what(), ": every rank rolls back to ", folder);
  }
  d.steps_recomputed = plan.steps_recomputed;
  d.world = std::move(plan.world);
  d.world.set_job_id(job.id);
  d.world.set_world_epoch(job.world_epoch + 1);
  for (const auto& m : maps) *d.world.add_maps() = m;
  for (auto& mv : moves) *d.world.add_moves() = std::move(mv);
  d.world.set_data_plane_key(new_data_plane_key());
  for (int n : d.nodes) d.world.add_nodes(members_.nodes()[n].name);
  return d;
}

// The change in the job's record (and the counters behind the metrics).
void Scheduler::record_change(const DecidedWorld& d) {
  const RunningJob& job = *running_;
  const RunningJob::Halt& h = *job.halt;
  const v1::NewWorld& w = d.world;
  v1::WorldChange& c = *book_.at(job.id).add_world_changes();
  c.set_world_epoch(w.world_epoch());
  c.set_step(w.resume_step());
  c.set_old_world(job.reports.world);
  c.set_new_world(w.world_size());
  c.set_cause(h.cause);
  c.set_kind(h.kind);
  for (int n : h.lost) c.add_lost_nodes(members_.nodes()[n].name);
  for (int n : h.joining) c.add_joined_nodes(members_.nodes()[n].name);
  c.set_detection_seconds(h.detection_seconds);
  c.set_experts_from_replicas(w.moves_size());
  c.set_experts_from_checkpoint(d.from_checkpoint);
  c.set_checkpoint(w.rollback());
  c.set_steps_recomputed(d.steps_recomputed);
  c.set_tokens_per_rank(w.tokens_per_rank());
  c.set_unix_ms(unix_ms());
  ++world_changes_[h.kind];
  log::warn("job ", job.id, ": world ", w.world_epoch(), " of ", w.world_size(), " ranks (was ", job.reports.world,
            ") resumes at step ", w.resume_step(), ", ", w.moves_size(), " expert state(s) from replicas, ",
            w.tokens_per_rank(), " tokens per rank");
}

// The running job moves onto the new world and its nodes are told. Steps
// before the resume step are whole (a lost rank's report of one may never
// come: its loss is in every survivor's report); the rest run again.
void Scheduler::enter_world(const DecidedWorld& d) {
  RunningJob& job = *running_;
  const v1::NewWorld& w = d.world;
  const std::set<int> joined = job.halt->joining;
  job.past_worlds[job.world_epoch] = {job.nodes, w.resume_step()};
  job.nodes = d.nodes;
  job.world_epoch = w.world_epoch();
  job.shape = d.shape;
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
  job.recovering_since = job.halt->started;
  job.restored = false;  // this agent decided the world: its ranks answer to it
  job.halt.reset();
  std::vector<int> survivors, joining;
  for (int n : job.nodes) (joined.count(n) ? joining : survivors).push_back(n);
  v1::StartJob join;
  if (!joining.empty()) {
    join.set_job_id(job.id);
    *join.mutable_spec() = job.reports.spec;
    join.set_world_size(w.world_size());
    join.set_devices_per_node(members_.devices_per_node());
    *join.mutable_maps() = w.maps();
    join.set_data_plane_key(w.data_plane_key());
    join.set_world_epoch(w.world_epoch());
    *join.mutable_join() = w;
    for (int n : joining) members_.mark_busy(job.id, n);
  }
  actions_.new_world(w, survivors, join, joining);
}

// The new world completed its first step: the change's recovery time.
void Scheduler::note_recovered(Clock::time_point now) {
  v1::JobResult& rec = book_.at(running_->id);
  const double took = seconds(now - *running_->recovering_since);
  if (rec.world_changes_size() > 0) rec.mutable_world_changes(rec.world_changes_size() - 1)->set_recovery_seconds(took);
  recovery_seconds_.push_back(took);
  running_->recovering_since.reset();
}

// A report from an earlier world: a survivor's step it applied on its way to
// the new world (kept beside the step's other reports), or a step that will run
// again (dropped). True when kept.
bool Scheduler::on_past_world_step(const v1::StepReport& r) {
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

}  // namespace moe::agent
