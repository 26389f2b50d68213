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
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "moe/jobs/job_book.h"
#include "moe/jobs/job_result.h"
#include "moe/cluster/membership.h"
#include "moe/cluster/placement_service.h"
#include "moe/v1/agent_state.pb.h"
#include "moe/v1/job_run.pb.h"
#include "moe/v1/placement.pb.h"

namespace moe::agent {

struct SchedulerOptions {
  // After a job failed, how long to wait for every rank to report before the
  // failure is recorded anyway (ranks blocked in a transport wait run into its
  // deadline first).
  std::chrono::milliseconds failed_job_grace{45000};
  // A running job from which no rank reported anything (bootstrap, step, done)
  // for this long is failed: a lost report must not hold the queue forever.
  std::chrono::milliseconds stale_job_timeout{30 * 60 * 1000};
  // A job restored as running by a restarted agent fails ("agent restarted")
  // when none of its ranks reports within this long: the daemons' --agent-grace
  // plus the heartbeat timeout.
  std::chrono::milliseconds restored_job_timeout{33000};
  // The daemons' heartbeat interval: a job's dead_node_timeout_ms is at least 4 of them.
  std::chrono::milliseconds heartbeat_interval{250};
  // An elastic job's world change fails when a surviving rank has not said what
  // it applied this long after the halt (its node is alive but stuck).
  std::chrono::milliseconds halt_timeout{20000};
};

// What the scheduler needs done outside itself.
class SchedulerActions {
 public:
  virtual ~SchedulerActions() = default;
  // Ask every node's daemon to start the job.
  virtual void start_job(const v1::StartJob& start) = 0;
  // Ask every live node's daemon to stop the job.
  // failed: the job failed (its ranks abort their transports); else a request.
  virtual void cancel_job(const std::string& job_id, const std::string& reason, bool failed) = 0;
  // The job reached a final state.
  virtual void job_ended(const v1::JobResult& result) = 0;
  // Every rank reported this step of the running job (its load is recorded).
  virtual void step_completed(const std::string& job_id, int step) = 0;
  // Elastic jobs (docs/jobs.md#elastic-jobs): stop world `epoch` of the job on
  // these nodes (indices; their ranks keep their state and report RankHalted).
  // A node that cannot be told comes back as Scheduler::on_halt_failed.
  virtual void halt_world(const std::string& job_id, int64_t epoch, const std::string& reason,
                          const std::vector<int>& nodes) = 0;
  // Move the job's surviving nodes onto a new world, and start the job on the
  // joining nodes with `join` (its join field set; a failure comes back as
  // Scheduler::on_start_failed).
  virtual void new_world(const v1::NewWorld& world, const std::vector<int>& nodes, const v1::StartJob& join,
                         const std::vector<int>& joining) = 0;
  // A node that left an elastic job's world still runs its part (it was
  // silent, not dead): stop it there (the job failed, as far as it is concerned).
  virtual void fence(const std::string& job_id, int node, const std::string& reason) = 0;
};

// The job that runs, and what its ranks reported so far.
struct RunningJob {
  std::string id;
  ShapeKey shape;
  JobReports reports;
  std::vector<bool> done;  // by rank
  int done_count = 0;
  bool failed = false, cancelled = false;
  bool reason_known = false;  // the cancel's message names its cause
  std::string message;
  Clock::time_point failed_at, last_report;
  int steps_recorded = 0;  // complete steps whose load is in the placement window
  // The slowest rank's seconds of the last complete steps (at most
  // kRecentSteps, newest last): the live step time of moectl top.
  static constexpr size_t kRecentSteps = 8;
  std::deque<double> recent_step_seconds;
  // A world's first step carries its warm-up (first touch of the ranks' buffers,
  // lazy setup: several times a later step on a fresh daemon). It leaves the
  // window once a later step is in it, so the pace and the ETA are the steady ones.
  bool next_step_warms_up = true;  // set again by a world change; kept by the agent's state
  bool warmup_in_window = false;   // the window's newest step is that first step
  Clock::time_point last_fill;  // when the record's result fields were last refreshed
  // Read back by a restarted agent: its daemons re-send every report. Until
  // each rank was heard from again, a failure is the restart's.
  bool restored = false;
  std::vector<bool> heard;  // by rank, since the restore
  Clock::time_point restored_at;
  bool ending() const { return failed || cancelled; }
  bool awaiting_ranks() const;
  // Every step complete and no world change under way: a lost node changes nothing.
  bool past_last_step() const { return steps_recorded >= reports.spec.steps() && !halt; }

  // Elastic jobs (docs/jobs.md#elastic-jobs): the current world's number and
  // nodes (indices, in rank order), each earlier world's nodes, and a world
  // change in progress: from the halt until every survivor said what it applied.
  int64_t world_epoch = 0;
  std::vector<int> nodes;
  struct PastWorld {
    std::vector<int> nodes;
    int next_step = 0;  // the step the next world resumed at: this world's steps end before it
  };
  std::map<int64_t, PastWorld> past_worlds;
  struct Halt {
    std::string kind;  // WorldChange.kind
    std::string cause;
    std::set<int> lost;                     // node indices
    std::set<int> joining;                  // node indices that registered and join the new world
    std::map<int, v1::RankHalted> halted;   // by rank of the halted world
    Clock::time_point started;
    double detection_seconds = 0;
  };
  std::optional<Halt> halt;
  // The new world's first step is not complete yet: when it is, the change's
  // recovery time is recorded (from this halt start).
  std::optional<Clock::time_point> recovering_since;
};

// A job's data-plane key: 32 bytes from the kernel's CSPRNG (docs/transport.md#job-key).
std::string new_data_plane_key();

class Scheduler {
 public:
  Scheduler(SchedulerOptions options, Membership& members, PlacementService& placement, SchedulerActions& actions);

  // Validates the spec (defaults filled) against the cluster and queues it.
  // Throws moe::InvalidArgument naming the field.
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
  const RunningJob* running() const { return running_.get(); }
  // Elastic jobs' world changes since the start, by WorldChange.kind, and each
  // one's recovery seconds (for the metrics).
  const std::map<std::string, int>& world_changes() const { return world_changes_; }
  const std::vector<double>& recovery_seconds() const { return recovery_seconds_; }
  static bool finished(v1::JobState s) { return JobBook::finished(s); }

  // Starts the queue's head when every node is alive and idle.
  void try_start(Clock::time_point now);
  // A step report; once every rank reported a step, its load goes to the
  // placement window and the job's progress shows.
  void on_step(const v1::StepReport& r, Clock::time_point now);
  // A rank of the job showed it is alive without a step (a bootstrap publish).
  void on_activity(const std::string& job_id, Clock::time_point now);
  void on_rank_done(const v1::RankDone& d, Clock::time_point now);
  void on_start_failed(const std::string& job_id, const std::string& node, const std::string& error,
                       Clock::time_point now);
  // A node stopped responding (why names it; node: its index, -1 unknown).
  void on_node_dead(const std::string& why, Clock::time_point now, int node = -1);
  // Elastic jobs: a rank halted its world; a node could not be told to halt.
  void on_rank_halted(const v1::RankHalted& h, Clock::time_point now);
  void on_halt_failed(const std::string& job_id, int64_t epoch, int node, const std::string& error,
                      Clock::time_point now);
  // The rank `rank` of world `epoch` of the running job as the node's own
  // numbering (node index x devices + local), which Membership counts.
  int home_rank(int rank, int64_t epoch) const;
  // "rank 3 (node node1)" in the running job's current world.
  std::string describe_rank(int rank) const;
  // Grace and silence deadlines of the running job.
  void tick(Clock::time_point now);
  // A node (re-)registered, running `running_job` ("" for none). A job restored
  // as running fails when one of its nodes comes back without it.
  void on_node_registered(const NodeRecord& node, const std::string& running_job, Clock::time_point now);
  // A node finished its part of a job (every rank reported done): an elastic
  // job it had left takes it back.
  void on_node_idle(const NodeRecord& node, Clock::time_point now);

  // Every job record, the queue and the running job, for the agent's state
  // directory; and back, where a running job waits for its daemons' reports.
  // restore throws moe::Error naming the inconsistent field.
  v1::SchedulerState state() const;
  void restore(const v1::SchedulerState& s, Clock::time_point now);

 private:
  bool start(v1::JobResult& rec, Clock::time_point now);
  std::vector<v1::PlacementMap> job_maps(v1::JobResult& rec);
  void fail_unstarted(v1::JobResult& rec, const std::string& message);
  void note_cancelled_rank(const v1::RankDone& d, Clock::time_point now);
  void record_load(const std::vector<v1::StepStats>& by_rank);
  void update_progress(v1::JobResult& rec, const std::vector<v1::StepStats>& by_rank, Clock::time_point now);
  std::string running_id() const { return running_ ? running_->id : ""; }
  void fail_running(const std::string& message, Clock::time_point now);
  // why, prefixed "agent restarted: " while a restored job waits for its ranks.
  std::string after_restart(const std::string& why) const;
  void heard_from(int rank, Clock::time_point now);
  void finish(v1::JobState state, const std::string& message);
  // Elastic (scheduler_elastic.cc).
  bool elastic_running() const;
  void node_lost(int node, const std::string& kind, const std::string& why, Clock::time_point now);
  void begin_halt(const std::string& kind, const std::string& cause, std::set<int> lost, Clock::time_point now);
  void node_joins(const NodeRecord& node, Clock::time_point now);
  void try_new_world(Clock::time_point now);
  bool halt_complete() const;
  struct DecidedWorld {
    v1::NewWorld world;
    std::vector<int> nodes;  // node indices, in rank order
    ShapeKey shape;
    int steps_recomputed = 0, from_checkpoint = 0;
  };
  DecidedWorld decide_world();
  void record_change(const DecidedWorld& d);
  void enter_world(const DecidedWorld& d);
  void note_recovered(Clock::time_point now);
  bool on_past_world_step(const v1::StepReport& r);

  SchedulerOptions opts_;
  Membership& members_;
  PlacementService& placement_;
  SchedulerActions& actions_;
  JobBook book_;
  std::unique_ptr<RunningJob> running_;
  std::map<std::string, int> world_changes_;
  std::vector<double> recovery_seconds_;
};

}  // namespace moe::agent
