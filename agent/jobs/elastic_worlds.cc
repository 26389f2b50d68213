#include "moe/jobs/elastic_worlds.h"

#include <algorithm>

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

ElasticWorlds::ElasticWorlds(const SchedulerOptions& opts, Membership& members, PlacementService& placement,
                             SchedulerActions& actions, JobBook& book, JobLifecycle& run)
    : opts_(opts), members_(members), placement_(placement), actions_(actions), book_(book), run_(run) {}

void ElasticWorlds::node_lost(int node, const std::string& kind, const std::string& why, Clock::time_point now) {
  RunningJob& job = this->job();
  const auto pos = std::find(job.nodes.begin(), job.nodes.end(), node);
  if (pos == job.nodes.end()) return;  // not in this world
  if (job.past_last_step()) {
    // Every step is complete: nothing to go on with. The node's ranks count as
    // done (their RankDones may never come); the job ends with the others'.
    log::warn("job ", job.id, ": ", why, " after its last step");
    const int D = members_.devices_per_node(), first = static_cast<int>(pos - job.nodes.begin()) * D;
    if (run_.mark_done(first, first + D)) run_.finish(v1::JOB_STATE_SUCCEEDED, "");
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
void ElasticWorlds::node_joins(const NodeRecord& node, Clock::time_point now) {
  RunningJob& job = this->job();
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

void ElasticWorlds::on_node_idle(const NodeRecord& node, Clock::time_point now) {
  if (run_.elastic_running() && node.state == v1::NODE_STATE_ALIVE &&
      std::find(job().nodes.begin(), job().nodes.end(), node.index) == job().nodes.end())
    node_joins(node, now);
}

void ElasticWorlds::on_rank_halted(const v1::RankHalted& h, Clock::time_point now) {
  if (!run_.elastic_running() || job().id != h.job_id() || h.world_epoch() != job().world_epoch) return;
  if (job().past_last_step()) return;  // its end is near
  if (h.rank() < 0 || h.rank() >= job().reports.world) return;
  run_.heard_from(h.rank(), now);
  if (!job().halt) {
    const bool blames = h.has_failed_peer() && h.failed_peer() >= 0 && h.failed_peer() != h.rank();
    begin_halt("peer_failed",
               blames ? run_.describe_rank(h.failed_peer()) + " failed (reported by " + run_.describe_rank(h.rank()) +
                            "): " + h.message()
                      : run_.describe_rank(h.rank()) + ": " + h.message(),
               {}, now);
  }
  job().halt->halted[h.rank()] = h;
  try_new_world(now);
}

void ElasticWorlds::on_halt_failed(const std::string& job_id, int64_t epoch, int node, const std::string& error,
                               Clock::time_point now) {
  if (!run_.elastic_running() || job().id != job_id || epoch != job().world_epoch || !job().halt) return;
  node_lost(node, "peer_failed", members_.describe_node(members_.nodes()[node]) + " cannot be reached (" + error + ")",
            now);
}

// A node that ran the job's last step has ended its part; a rank finishes only
// after every collective of every step completed, so the lost nodes computed every
// step too, and only their last reports are missing. When the node is the last
// one not lost, the halt ends: the lost nodes' ranks count as done and the job
// ends with the node's RankDones (success, or the failure they name). With other
// nodes still in the world, the node leaves it as a lost one would.
void ElasticWorlds::on_part_ended(const std::string& job_id, int64_t epoch, int node, Clock::time_point now) {
  if (!run_.elastic_running() || job().id != job_id || epoch != job().world_epoch || !job().halt) return;
  RunningJob& j = job();
  for (int n : j.nodes)
    if (n != node && !j.halt->lost.count(n))
      return node_lost(node, "peer_failed",
                       members_.describe_node(members_.nodes()[node]) + " ended its part of the job during the halt", now);
  log::warn("job ", j.id, ": ", members_.describe_node(members_.nodes()[node]),
            " ran the last step before the halt: the lost node(s) ran it too; the job ends with its reports");
  const int D = members_.devices_per_node();
  const std::set<int> lost = j.halt->lost;
  j.halt.reset();
  for (size_t pos = 0; pos < j.nodes.size(); ++pos)
    if (lost.count(j.nodes[pos])) run_.mark_done(static_cast<int>(pos) * D, static_cast<int>(pos + 1) * D);
  run_.finish_if_all_done();
}

// Every node of the world stops it; a node already known lost is not asked.
void ElasticWorlds::begin_halt(const std::string& kind, const std::string& cause, std::set<int> lost,
                           Clock::time_point now) {
  RunningJob& job = this->job();
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
bool ElasticWorlds::halt_complete() const {
  const RunningJob& job = this->job();
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
void ElasticWorlds::try_new_world(Clock::time_point now) {
  if (!halt_complete()) return;
  DecidedWorld next;
  try {
    next = decide_world();
  } catch (const moe::Error& e) {
    return run_.fail_running("elastic: " + std::string(e.what()) + " (world " + std::to_string(job().world_epoch) +
                                 " halted: " + job().halt->cause + ")",
                             now);
  }
  record_change(next);
  enter_world(next);
}

// The new world (world_change.h) with its maps and expert moves; when an expert
// has no surviving copy, a rollback to the job's latest checkpoint instead.
// Throws moe::Error naming what cannot go on.
ElasticWorlds::DecidedWorld ElasticWorlds::decide_world() {
  RunningJob& job = this->job();
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
  const std::vector<v1::PlacementMap> maps = placement_.maps_for_world(job.reports.spec, job.shape, d.shape, job.id + "'s world change");
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
void ElasticWorlds::record_change(const DecidedWorld& d) {
  const RunningJob& job = this->job();
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
  ++counts_[h.kind];
  log::warn("job ", job.id, ": world ", w.world_epoch(), " of ", w.world_size(), " ranks (was ", job.reports.world,
            ") resumes at step ", w.resume_step(), ", ", w.moves_size(), " expert state(s) from replicas, ",
            w.tokens_per_rank(), " tokens per rank");
}

// The running job moves onto the new world and its nodes are told. Steps
// before the resume step are whole (a lost rank's report of one may never
// come: its loss is in every survivor's report); the rest run again.
void ElasticWorlds::enter_world(const DecidedWorld& d) {
  RunningJob& job = this->job();
  const v1::NewWorld& w = d.world;
  const std::set<int> joined = job.halt->joining;
  job.past_worlds[job.world_epoch] = {job.nodes, w.resume_step()};
  job.nodes = d.nodes;
  job.world_epoch = w.world_epoch();
  run_.move_to_world(w, d.shape);
  job.recovering_since = job.halt->started;
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
void ElasticWorlds::on_step_complete(Clock::time_point now) {
  if (!job().recovering_since) return;
  v1::JobResult& rec = book_.at(job().id);
  const double took = seconds(now - *job().recovering_since);
  if (rec.world_changes_size() > 0) rec.mutable_world_changes(rec.world_changes_size() - 1)->set_recovery_seconds(took);
  recovery_seconds_.push_back(took);
  job().recovering_since.reset();
}

// The halt deadline: a surviving rank that has not said what it applied
// fails the job (its node is alive but stuck).
bool ElasticWorlds::tick(Clock::time_point now) {
  const RunningJob& job = this->job();
  if (!job.halt || job.ending() || now - job.halt->started <= opts_.halt_timeout) return false;
  std::string missing;
  const int D = members_.devices_per_node();
  for (size_t pos = 0; pos < job.nodes.size(); ++pos) {
    if (job.halt->lost.count(job.nodes[pos])) continue;
    for (int d = 0; d < D; ++d) {
      const int r = static_cast<int>(pos) * D + d;
      if (!job.halt->halted.count(r)) missing += (missing.empty() ? "" : ", ") + run_.describe_rank(r);
    }
  }
  run_.fail_running("elastic: " + missing + " did not halt within " +
                        std::to_string(std::chrono::duration_cast<std::chrono::seconds>(opts_.halt_timeout).count()) +
                        " s of the world change after: " + job.halt->cause,
                    now);
  return true;
}

// A node of the running elastic job registered: one that left the world (silent,
// not dead) and woke with its old part is fenced; one of the world that
// restarted lost its ranks' state, so it leaves the world and joins the next one
// as a new node (in one world change when the first is still being decided); a
// node the job lost came back and joins.
void ElasticWorlds::on_node_registered(const NodeRecord& node, const std::string& running_job, Clock::time_point now) {
  const bool in_world = std::find(job().nodes.begin(), job().nodes.end(), node.index) != job().nodes.end();
  if (running_job == job().id) {
    if (!in_world)
      actions_.fence(job().id, node.index,
                     members_.describe_node(node) + " left the job's world; world " +
                         std::to_string(job().world_epoch) + " runs without it");
    return;
  }
  if (in_world)
    node_lost(node.index, "node_restarted",
              members_.describe_node(node) + " restarted during the job (its ranks' state is lost)", now);
  if (run_.elastic_running() && running_job.empty()) node_joins(node, now);
}

}  // namespace moe::agent
