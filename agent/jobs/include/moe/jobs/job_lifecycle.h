// A job's lifecycle (docs/jobs.md): the one running job, from its start (maps,
// StartJob to every node) through its ranks' reports (steps, done, failures) to
// its end (the result built from the reports), with the grace and silence
// deadlines. It owns the running job; an elastic job's world changes
// (elastic_worlds.h) move it between worlds through move_to_world.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moe/cluster/membership.h"
#include "moe/cluster/placement_service.h"
#include "moe/jobs/job_book.h"
#include "moe/jobs/running_job.h"

namespace moe::agent {

class JobLifecycle {
 public:
  JobLifecycle(const SchedulerOptions& opts, Membership& members, PlacementService& placement,
               SchedulerActions& actions, JobBook& book);

  const RunningJob* running() const { return running_.get(); }
  RunningJob* running() { return running_.get(); }
  // An elastic job that is not ending: a lost node changes its world.
  bool elastic_running() const;

  // QUEUED -> RUNNING (true), or -> FAILED when the cluster cannot run the spec.
  bool start(v1::JobResult& rec, Clock::time_point now);
  // A step report; the step once every rank reported it (its load then went to
  // the placement window and the job's progress shows), else nullopt.
  std::optional<int> on_step(const v1::StepReport& r, Clock::time_point now);
  void on_activity(const std::string& job_id, Clock::time_point now);
  void on_rank_done(const v1::RankDone& d, Clock::time_point now);
  void on_start_failed(const std::string& job_id, const std::string& node, const std::string& error,
                       Clock::time_point now);
  // A node of a job that does not change worlds died (or an unknown one).
  void on_node_dead(const std::string& why, Clock::time_point now);
  // The grace, silence and restore deadlines.
  void tick(Clock::time_point now);
  // The running job is cancelled through its daemons (when it is not ending already).
  void cancel(Clock::time_point now);
  // A node of a job that does not change worlds registered again without it:
  // its ranks count as done and the job fails (docs/jobs.md#a-node-restarts).
  void node_restarted(const NodeRecord& node, const std::string& running_job, Clock::time_point now);

  // RUNNING -> failing: the daemons are told to stop; the job ends when every
  // rank reported, at once if a node is dead (it never will), or after the grace.
  void fail_running(const std::string& message, Clock::time_point now);
  // RUNNING -> a final state, with the result built from the step reports.
  void finish(v1::JobState state, const std::string& message);
  // A rank of the job was heard from (-1: one of an earlier world).
  void heard_from(int rank, Clock::time_point now);
  // Its ranks `from`..`to` - 1 count as done (they will never report); true when every rank is.
  bool mark_done(int from, int to);
  // Every rank is done: the job ends, as its reports say (cancelled, failed or succeeded).
  void finish_if_all_done();
  // The job moves onto a new world (elastic_worlds.h): its shape, size and
  // reports restart at the resume step; the world's own fields are the caller's.
  void move_to_world(const v1::NewWorld& w, const ShapeKey& shape);

  // The rank `rank` of world `epoch` as the node's own numbering (node index x
  // devices + local), which Membership counts.
  int home_rank(int rank, int64_t epoch) const;
  // "rank 3 (node node1)" in the running job's current world.
  std::string describe_rank(int rank) const;
  // why, prefixed "agent restarted: " while a restored job waits for its ranks.
  std::string after_restart(const std::string& why) const;
  std::string node_lost_message(const std::string& why) const;

  // The running job for the agent's state, and back.
  void save(v1::SchedulerState& s) const;
  void adopt(std::unique_ptr<RunningJob> job) { running_ = std::move(job); }

 private:
  std::vector<v1::PlacementMap> job_maps(v1::JobResult& rec);
  void fail_unstarted(v1::JobResult& rec, const std::string& message);
  void note_cancelled_rank(const v1::RankDone& d, Clock::time_point now);
  void record_load(const std::vector<v1::StepStats>& by_rank);
  static bool has_rows(const std::vector<v1::StepStats>& by_rank);
  void update_progress(v1::JobResult& rec, const std::vector<v1::StepStats>& by_rank, Clock::time_point now);
  bool on_past_world_step(const v1::StepReport& r);

  const SchedulerOptions& opts_;
  Membership& members_;
  PlacementService& placement_;
  SchedulerActions& actions_;
  JobBook& book_;
  std::unique_ptr<RunningJob> running_;
};

}  // namespace moe::agent
