// The scheduler across agent restarts (docs/jobs.md#agent-away,
// docs/placement.md#agent-persistence): its records, queue and running job to and
// from the agent's state, and how a job restored as running resumes (its daemons
// re-send every report) or fails ("agent restarted").
#include <algorithm>
#include <set>

#include "moe/jobs/scheduler.h"
#include "moe/base/check.h"
#include "moe/base/log.h"

namespace moe::agent {

bool RunningJob::awaiting_ranks() const {
  return restored && std::find(heard.begin(), heard.end(), false) != heard.end();
}

std::string Scheduler::after_restart(const std::string& why) const {
  return running_ && running_->awaiting_ranks() ? "agent restarted: " + why : why;
}

void Scheduler::heard_from(int rank, Clock::time_point now) {
  running_->last_report = now;
  if (running_->restored && rank >= 0 && rank < static_cast<int>(running_->heard.size())) running_->heard[rank] = true;
}

// A node of the running job registered again without it: the daemon restarted
// (or, after an agent restart, lost the job). Its ranks' part ended with the old
// process and they will never report: they count as done, the job fails at once
// and the survivors abort their transports (docs/jobs.md#a-node-restarts).
void Scheduler::on_node_registered(const NodeRecord& node, const std::string& running_job, Clock::time_point now) {
  // A node back from silence with the part of a job that ended meanwhile (an
  // elastic job went on without it): nothing will come for that part; stop it.
  if (const auto ended = book_.jobs().find(running_job);
      ended != book_.jobs().end() && finished(ended->second.state()) && (!running_ || running_->id != running_job))
    actions_.fence(running_job, node.index, members_.describe_node(node) + " came back after " + running_job + " ended");
  if (!running_) return;
  if (running_job == running_->id) {
    // A node the elastic job left (silent, not dead) woke with its old part: fenced.
    if (elastic_running() && std::find(running_->nodes.begin(), running_->nodes.end(), node.index) == running_->nodes.end())
      actions_.fence(running_->id, node.index,
                     members_.describe_node(node) + " left the job's world; world " +
                         std::to_string(running_->world_epoch) + " runs without it");
    return;
  }
  if (elastic_running()) {  // docs/jobs.md#elastic-jobs
    // A node of the world that restarted lost its ranks' state: it leaves the
    // world and joins the next one as a new node (in one world change when
    // the first is still being decided); a node the job lost came back.
    if (std::find(running_->nodes.begin(), running_->nodes.end(), node.index) != running_->nodes.end())
      node_lost(node.index, "node_restarted",
                members_.describe_node(node) + " restarted during the job (its ranks' state is lost)", now);
    if (elastic_running() && running_job.empty()) node_joins(node, now);
    return;
  }
  RunningJob& job = *running_;
  const int D = members_.devices_per_node();
  for (int r = node.index * D; r < (node.index + 1) * D && r < job.reports.world; ++r)
    if (!job.done[r]) {
      job.done[r] = true;
      ++job.done_count;
    }
  if (job.ending()) {
    if (job.done_count == job.reports.world) finish(job.failed ? v1::JOB_STATE_FAILED : v1::JOB_STATE_CANCELLED, job.message);
    return;
  }
  const std::string came_back =
      members_.describe_node(node) + " came back " + (running_job.empty() ? "running no job" : "running " + running_job);
  fail_running(job.awaiting_ranks() ? "agent restarted: " + came_back
                                    : members_.describe_node(node) + " restarted during the job (its ranks' state is lost)",
               now);
}

v1::SchedulerState Scheduler::state() const {
  v1::SchedulerState s;
  book_.save(s);
  if (running_) {
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
  return s;
}

namespace {

// The running job of a restored state: it waits for its ranks to report again.
std::unique_ptr<RunningJob> restored_job(const v1::RunningJobState& r, const v1::JobResult& rec, Clock::time_point now) {
  auto job = std::make_unique<RunningJob>();
  job->id = r.job_id();
  job->shape = ShapeKey::of(r.shape());
  job->reports.spec = rec.spec();
  job->reports.world = r.world_size();
  job->reports.verify.assign(r.world_size(), {});
  job->done.assign(r.world_size(), false);
  job->last_report = now;
  job->steps_recorded = static_cast<int>(rec.steps_completed());
  job->next_step_warms_up = r.warmup_pending();
  job->restored = true;
  job->heard.assign(r.world_size(), false);
  job->restored_at = now;
  job->world_epoch = r.world_epoch();
  job->nodes.assign(r.nodes().begin(), r.nodes().end());
  if (r.tokens_per_rank() > 0) job->reports.spec.set_tokens_per_rank(r.tokens_per_rank());
  for (const v1::PastWorldState& p : r.past_worlds())
    job->past_worlds[p.world_epoch()] = {{p.nodes().begin(), p.nodes().end()}, p.next_step()};
  return job;
}

}  // namespace

void Scheduler::restore(const v1::SchedulerState& s, Clock::time_point now) {
  std::map<std::string, v1::JobResult> jobs;
  for (const v1::JobResult& rec : s.jobs()) {
    MOE_CHECK(!rec.job_id().empty(), "scheduler.jobs[", jobs.size(), "].job_id: empty");
    MOE_CHECK(jobs.emplace(rec.job_id(), rec).second, "scheduler.jobs: ", rec.job_id(), " appears twice");
  }
  const std::set<std::string> queued(s.queue().begin(), s.queue().end());
  const std::string& running = s.running().job_id();
  for (const auto& [id, rec] : jobs) {
    MOE_CHECK((rec.state() == v1::JOB_STATE_QUEUED) == (queued.count(id) > 0), "scheduler.queue: job ", id, " is ",
              v1::JobState_Name(rec.state()), (queued.count(id) ? " but queued" : " but not queued"));
    MOE_CHECK((rec.state() == v1::JOB_STATE_RUNNING) == (id == running), "scheduler.running.job_id: '", running,
              "', but job ", id, " is ", v1::JobState_Name(rec.state()));
  }
  MOE_CHECK(queued.size() == static_cast<size_t>(s.queue_size()), "scheduler.queue: a job appears twice");
  MOE_CHECK(s.next_job() > static_cast<int64_t>(jobs.size()), "scheduler.next_job: ", s.next_job(), " with ",
            jobs.size(), " jobs recorded");
  std::unique_ptr<RunningJob> job;
  if (!running.empty()) {
    MOE_CHECK(jobs.count(running), "scheduler.running.job_id: no record of ", running);
    MOE_CHECK(s.running().world_size() >= 1, "scheduler.running.world_size: ", s.running().world_size());
    const int D = members_.devices_per_node();
    if (s.running().nodes_size() == 0) {  // a state written before elastic jobs: every node
      MOE_CHECK(s.running().world_size() == members_.world_size(), "scheduler.running.world_size: ",
                s.running().world_size(), ", but the membership has ", members_.world_size(), " ranks");
    } else {
      MOE_CHECK(s.running().world_size() == s.running().nodes_size() * D, "scheduler.running.world_size: ",
                s.running().world_size(), ", but its ", s.running().nodes_size(), " node(s) hold ",
                s.running().nodes_size() * D, " ranks");
      for (int n : s.running().nodes())
        MOE_CHECK(n >= 0 && n < members_.num_nodes(), "scheduler.running.nodes: no node ", n);
    }
    job = restored_job(s.running(), jobs.at(running), now);
    if (job->nodes.empty())
      for (int n = 0; n < members_.num_nodes(); ++n) job->nodes.push_back(n);
    log::info("job ", running, " was running when the agent stopped (", job->steps_recorded,
              " steps recorded): waiting for its daemons");
  }
  book_.restore(std::move(jobs), s);
  running_ = std::move(job);
}

}  // namespace moe::agent
