// Live rebalancing (docs/placement.md#live-rebalance): new maps from the measured
// load, moved into a running job without stopping it.
//
//   plan (PlacementService) -> PREPARE(epoch, maps, copies) to every daemon
//   -> each daemon fills the slots it gains in the background and answers
//      READY (or NO with the reason naming the copy)
//   -> every node READY within the timeout: install the maps as the epoch,
//      COMMIT to every daemon (the ranks switch at a step boundary they agree on)
//   -> a NO, or the timeout: ABORT; every rank keeps the old map.
// With no job running on the shape the maps are installed at once (the next job
// starts on them); a dry run installs nothing. One rebalance at a time. Like the
// scheduler, no I/O of its own: the agent passes `now` and carries the messages.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "moe/cluster/membership.h"
#include "moe/cluster/placement_service.h"
#include "moe/jobs/scheduler.h"

namespace moe::agent {

struct RebalanceOptions {
  std::chrono::milliseconds timeout{60000};  // PREPARE -> every READY
};

// What the rebalancer needs done outside itself.
class RebalanceActions {
 public:
  virtual ~RebalanceActions() = default;
  virtual void prepare(const v1::PrepareRebalance& p) = 0;  // to every node
  virtual void commit(const v1::CommitRebalance& c) = 0;
  virtual void abort(const v1::AbortRebalance& a) = 0;
  virtual void rebalance_done(const v1::RebalanceReply& r) = 0;
};

class Rebalancer {
 public:
  Rebalancer(RebalanceOptions options, PlacementService& placement, const Scheduler& scheduler,
             const Membership& members, RebalanceActions& actions);

  // Starts a rebalance and returns its id; a dry run, or one with no job on the
  // shape, completes at once. Throws moe::InvalidArgument for a request that
  // breaks a rule, rpc::RpcError(FAILED_PRECONDITION) while another is in flight.
  uint64_t start(const v1::RebalanceRequest& req, Clock::time_point now);
  // The reply of a finished rebalance; null while it runs (or for an unknown id).
  const v1::RebalanceReply* result(uint64_t id) const;
  bool in_flight() const { return live_.has_value(); }

  void on_ready(const v1::RebalanceReady& r, Clock::time_point now);
  // PREPARE could not be delivered to a node.
  void on_prepare_failed(int64_t epoch, const std::string& node, const std::string& error, Clock::time_point now);
  // The job ended (any state) while a rebalance of it was in flight.
  void on_job_ended(const std::string& job_id, const std::string& why, Clock::time_point now);
  // An elastic job's world halted (docs/jobs.md#elastic-jobs): its rebalance in
  // flight fails, since the ranks it names are gone.
  void on_world_halted(const std::string& job_id, const std::string& why, Clock::time_point now);
  void tick(Clock::time_point now);

  // For metrics: rebalances by result, and the seconds of finished live ones.
  const std::map<v1::RebalanceResult, int64_t>& counts() const { return counts_; }
  const std::vector<double>& durations() const { return durations_; }
  // An automatic attempt that could not start (its request broke a rule).
  void record_failed_attempt() { ++counts_[v1::REBALANCE_RESULT_FAILED]; }

 private:
  struct Live {
    uint64_t id;
    v1::RebalanceReply reply;
    v1::PrepareRebalance prepare;
    std::set<std::string> waiting;  // nodes that have not answered READY
    Clock::time_point started;
  };
  v1::RebalanceReply plan_reply(const v1::RebalanceRequest& req, const RunningJob* job) const;
  void finish(v1::RebalanceResult result, const std::string& message, Clock::time_point now);
  void complete(uint64_t id, v1::RebalanceReply reply);

  RebalanceOptions opts_;
  PlacementService& placement_;
  const Scheduler& scheduler_;
  const Membership& members_;
  RebalanceActions& actions_;
  uint64_t next_id_ = 1;
  std::optional<Live> live_;
  std::map<uint64_t, v1::RebalanceReply> done_;  // the last few, for their waiters
  std::map<v1::RebalanceResult, int64_t> counts_;
  std::vector<double> durations_;
};

// Bytes one expert copy moves in a job: its fp32 weights (gate, up, down), and
// in train mode the fp32 masters and, with Adam, both moments instead.
double expert_copy_bytes(const v1::JobSpec& spec);

}  // namespace moe::agent
