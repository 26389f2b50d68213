// What the scheduler's rooms share (scheduler.h): its options, the actions it
// asks of the agent, and the running job with what its ranks reported so far.
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "moe/cluster/membership.h"
#include "moe/cluster/placement_service.h"
#include "moe/jobs/job_result.h"
#include "moe/v1/job_run.pb.h"

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
  // Every step complete and no world change under way: a lost node changes
  // nothing. A serving job has no last step (docs/serving.md#elastic-serving).
  bool past_last_step() const {
    return reports.spec.mode() != v1::JobSpec::serve && steps_recorded >= reports.spec.steps() && !halt;
  }

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

}  // namespace moe::agent
