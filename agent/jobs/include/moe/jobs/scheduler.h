// The scheduler: the job queue and the job state machine, every transition in
// one place:
//
//   submit -> QUEUED -> (every node alive and idle) RUNNING -> SUCCEEDED
//                 \                                   \-> FAILED (a rank failed, a node died,
//                  \-> CANCELLED (cancel)               a start call failed, silence)
//                                                      \-> CANCELLED (cancel, a daemon stopping)
//   QUEUED -> FAILED when the job cannot start (spec vs cluster, placement, an
//   unusable checkpoint).
//
// One job runs at a time, on every rank. No network and no clock of its own: the
// agent passes `now`, and what must reach the daemons goes through
// SchedulerActions, so the whole machine is unit-tested without processes. Its
// one file access: starting a job that resumes from a checkpoint reads the
// checkpoint's manifest and checks its files' sizes (spec::load_for_resume,
// docs/jobs.md#checkpoints-and-resume).
//
// Its rooms, each owning its state: JobBook (admission, the queue, the
// records), JobLifecycle (the running job from start to result) and
// ElasticWorlds (an elastic job's world changes). Scheduler routes the agent's
// events between them and keeps the agent's state across restarts.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "moe/jobs/elastic_worlds.h"
#include "moe/jobs/job_book.h"
#include "moe/jobs/job_lifecycle.h"
#include "moe/jobs/running_job.h"
#include "moe/v1/agent_state.pb.h"

namespace moe::agent {

class Scheduler {
 public:
  Scheduler(SchedulerOptions options, Membership& members, PlacementService& placement, SchedulerActions& actions);
  Scheduler(const Scheduler&) = delete;  // its rooms hold references into it
  Scheduler& operator=(const Scheduler&) = delete;

  // Validates the spec (defaults filled) against the cluster and queues it.
  // Throws moe::InvalidArgument naming the field.
  // Queues the job; its record names the placement it would start on when the
  // shape carries one from earlier jobs (PlacementService::carries_state).
  const v1::JobResult& submit(v1::JobSpec spec);
  // Cancels a queued job at once, a running one through its daemons.
  const v1::JobResult& cancel(const std::string& id, Clock::time_point now);
  // The records and the queue (JobBook's).
  const v1::JobResult& record(const std::string& id) const { return book_.record(id); }
  v1::JobResult view(const std::string& id) const { return book_.view(id, running_id()); }
  std::vector<v1::JobResult> list() const { return book_.list(running_id()); }
  void note_rebalance(const std::string& job_id, const std::string& why) { book_.note_rebalance(job_id, why); }
  const std::map<std::string, v1::JobResult>& jobs() const { return book_.jobs(); }
  int queued() const { return book_.queued(); }
  std::map<v1::JobState, int> counts() const { return book_.counts(); }
  static bool finished(v1::JobState s) { return JobBook::finished(s); }
  const RunningJob* running() const { return run_.running(); }
  // Elastic jobs' world changes since the start, by WorldChange.kind, and each
  // one's recovery seconds (for the metrics).
  const std::map<std::string, int>& world_changes() const { return worlds_.counts(); }
  const std::vector<double>& recovery_seconds() const { return worlds_.recovery_seconds(); }

  // Starts the queue's head when every node is alive and idle.
  void try_start(Clock::time_point now);
  // A step report; once every rank reported a step, its load goes to the
  // placement window and the job's progress shows.
  void on_step(const v1::StepReport& r, Clock::time_point now);
  // A rank of the job showed it is alive without a step (a bootstrap publish).
  void on_activity(const std::string& job_id, Clock::time_point now) { run_.on_activity(job_id, now); }
  void on_rank_done(const v1::RankDone& d, Clock::time_point now) { run_.on_rank_done(d, now); }
  void on_start_failed(const std::string& job_id, const std::string& node, const std::string& error,
                       Clock::time_point now) {
    run_.on_start_failed(job_id, node, error, now);
  }
  // A node stopped responding (why names it; node: its index, -1 unknown).
  void on_node_dead(const std::string& why, Clock::time_point now, int node = -1);
  // Elastic jobs: a rank halted its world; a node could not be told to halt.
  void on_rank_halted(const v1::RankHalted& h, Clock::time_point now) { worlds_.on_rank_halted(h, now); }
  void on_halt_failed(const std::string& job_id, int64_t epoch, int node, const std::string& error,
                      Clock::time_point now) {
    worlds_.on_halt_failed(job_id, epoch, node, error, now);
  }
  // A node told to halt answered that the job's part there has already ended.
  void on_halt_found_ended(const std::string& job_id, int64_t epoch, int node, Clock::time_point now) {
    worlds_.on_part_ended(job_id, epoch, node, now);
  }
  int home_rank(int rank, int64_t epoch) const { return run_.home_rank(rank, epoch); }
  std::string describe_rank(int rank) const { return run_.describe_rank(rank); }
  // Grace and silence deadlines of the running job.
  void tick(Clock::time_point now);
  // A node (re-)registered, running `running_job` ("" for none). A job restored
  // as running fails when one of its nodes comes back without it.
  void on_node_registered(const NodeRecord& node, const std::string& running_job, Clock::time_point now);
  // A node finished its part of a job (every rank reported done): an elastic
  // job it had left takes it back.
  void on_node_idle(const NodeRecord& node, Clock::time_point now) { worlds_.on_node_idle(node, now); }

  // Every job record, the queue and the running job, for the agent's state
  // directory; and back, where a running job waits for its daemons' reports.
  // restore throws moe::Error naming the inconsistent field.
  v1::SchedulerState state() const;
  void restore(const v1::SchedulerState& s, Clock::time_point now);

 private:
  std::string running_id() const { return run_.running() ? run_.running()->id : ""; }

  const SchedulerOptions opts_;
  const Membership& members_;
  const PlacementService& placement_;
  SchedulerActions& actions_;
  JobBook book_;
  JobLifecycle run_;
  ElasticWorlds worlds_;
};

}  // namespace moe::agent
