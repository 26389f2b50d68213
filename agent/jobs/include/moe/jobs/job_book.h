// Admission and the queue (docs/jobs.md#progress): every job's record by id, the
// jobs waiting to start in submit order, and the next job number. A spec is
// checked against the cluster when it is submitted, so a job that cannot run is
// refused then, not failed later. The Scheduler's other rooms change a record
// only through at(); nothing here knows which job runs (callers pass its id).
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "moe/cluster/membership.h"
#include "moe/v1/agent_state.pb.h"
#include "moe/v1/job_run.pb.h"

namespace moe::agent {

class JobBook {
 public:
  // heartbeat_interval: the daemons'; a job's dead_node_timeout_ms is at least 4 of them.
  JobBook(std::chrono::milliseconds heartbeat_interval, const Membership& members);

  // Validates the spec (defaults filled) against the cluster and queues it.
  // Throws moe::InvalidArgument naming the field.
  v1::JobResult& submit(v1::JobSpec spec);
  const v1::JobResult& record(const std::string& id) const;  // throws rpc::RpcError(NOT_FOUND)
  v1::JobResult& at(const std::string& id);                  // the same, to change it
  // The record as moectl shows it: a queued job's progress says what it waits
  // for (running_id: the job that runs, "" for none).
  v1::JobResult view(const std::string& id, const std::string& running_id) const;
  // Every record as view() shows it, in submit order (job-2 before job-10).
  std::vector<v1::JobResult> list(const std::string& running_id) const;
  // An automatic rebalance of a job could not run: why, on its record.
  void note_rebalance(const std::string& job_id, const std::string& why);
  const std::map<std::string, v1::JobResult>& jobs() const { return jobs_; }
  int queued() const { return static_cast<int>(queue_.size()); }
  std::map<v1::JobState, int> counts() const;  // every state present
  static bool finished(v1::JobState s);

  // The queue's head, taken off it (nullopt: none queued).
  std::optional<std::string> take_next();
  // A queued job is cancelled: off the queue, CANCELLED. False when it is not queued.
  bool cancel_queued(const std::string& id);

  // The records, the queue and the next number, to the agent's state and back
  // (restore checks nothing: the Scheduler checks the whole state first).
  void save(v1::SchedulerState& s) const;
  void restore(std::map<std::string, v1::JobResult> jobs, const v1::SchedulerState& s);

 private:
  std::string waiting_for(const std::string& id, const std::string& running_id) const;

  const std::chrono::milliseconds heartbeat_interval_;
  const Membership& members_;
  std::map<std::string, v1::JobResult> jobs_;
  std::deque<std::string> queue_;
  int64_t next_job_ = 1;
};

}  // namespace moe::agent
