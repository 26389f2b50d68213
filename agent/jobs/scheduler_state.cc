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

// A node (re-)registered. A node back from silence with the part of a job that
// ended meanwhile (an elastic job went on without it) is fenced: nothing will
// come for that part. An elastic job's world changes decide about its nodes; a
// node of another running job that comes back without it fails the job
// (docs/jobs.md#a-node-restarts).
void Scheduler::on_node_registered(const NodeRecord& node, const std::string& running_job, Clock::time_point now) {
  if (const auto ended = book_.jobs().find(running_job);
      ended != book_.jobs().end() && finished(ended->second.state()) && running_id() != running_job)
    actions_.fence(running_job, node.index, members_.describe_node(node) + " came back after " + running_job + " ended");
  if (!run_.running()) return;
  if (running_job == running_id()) {
    if (run_.elastic_running()) worlds_.on_node_registered(node, running_job, now);
    return;
  }
  if (run_.elastic_running()) return worlds_.on_node_registered(node, running_job, now);
  run_.node_restarted(node, running_job, now);
}

v1::SchedulerState Scheduler::state() const {
  v1::SchedulerState s;
  book_.save(s);
  run_.save(s);
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
  run_.adopt(std::move(job));
}

}  // namespace moe::agent
