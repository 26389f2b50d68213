// An elastic job's world changes (docs/jobs.md#elastic-jobs): a lost node, a
// rank whose world failed or a node that joins halts the job's world; once every
// surviving rank said what it applied, the new world is decided (world_change.h,
// pure), its experts placed, the change recorded, and the survivors moved there.
// It owns the counters of the changes; the running job is the lifecycle's.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "moe/jobs/job_lifecycle.h"

namespace moe::agent {

class ElasticWorlds {
 public:
  ElasticWorlds(const SchedulerOptions& opts, Membership& members, PlacementService& placement,
                SchedulerActions& actions, JobBook& book, JobLifecycle& run);

  // A node of the running elastic job's world is lost (kind: WorldChange.kind).
  void node_lost(int node, const std::string& kind, const std::string& why, Clock::time_point now);
  // A node outside the world registered idle, or finished its part: it joins.
  void node_joins(const NodeRecord& node, Clock::time_point now);
  void on_node_idle(const NodeRecord& node, Clock::time_point now);
  void on_rank_halted(const v1::RankHalted& h, Clock::time_point now);
  void on_halt_failed(const std::string& job_id, int64_t epoch, int node, const std::string& error,
                      Clock::time_point now);
  // A node told to halt had already ended its part of the job (its ranks ran the
  // last step, or failed: their RankDones say which).
  void on_part_ended(const std::string& job_id, int64_t epoch, int node, Clock::time_point now);
  // A node of the running elastic job registered, running `running_job`.
  void on_node_registered(const NodeRecord& node, const std::string& running_job, Clock::time_point now);
  // The halt deadline: true when it failed the job.
  bool tick(Clock::time_point now);
  // A step of the running job is complete: a new world's first one ends its recovery.
  void on_step_complete(Clock::time_point now);

  // World changes since the start, by WorldChange.kind, and each one's recovery seconds.
  const std::map<std::string, int>& counts() const { return counts_; }
  const std::vector<double>& recovery_seconds() const { return recovery_seconds_; }

 private:
  struct DecidedWorld {
    v1::NewWorld world;
    std::vector<int> nodes;  // node indices, in rank order
    ShapeKey shape;
    int steps_recomputed = 0, from_checkpoint = 0;
  };
  void begin_halt(const std::string& kind, const std::string& cause, std::set<int> lost, Clock::time_point now);
  void try_new_world(Clock::time_point now);
  bool halt_complete() const;
  DecidedWorld decide_world();
  void record_change(const DecidedWorld& d);
  void enter_world(const DecidedWorld& d);
  RunningJob& job() { return *run_.running(); }
  const RunningJob& job() const { return *run_.running(); }

  const SchedulerOptions& opts_;
  Membership& members_;
  PlacementService& placement_;
  SchedulerActions& actions_;
  JobBook& book_;
  JobLifecycle& run_;
  std::map<std::string, int> counts_;
  std::vector<double> recovery_seconds_;
};

}  // namespace moe::agent
