// An elastic job's worlds on this node (docs/jobs.md#elastic-jobs): the agent's
// halts and new worlds arrive here from the daemon's RPC thread; the ranks wait
// here for the world after theirs and find each world's in-process hub here.
// JobRunner owns one per job; the transition itself is world_change.h's.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "moe/transport/local_hub.h"
#include "moe/v1/job_run.pb.h"

namespace moe::node {

class WorldMailbox {
 public:
  // The job's first world here: its epoch and this node's ranks in it.
  // give_up(why) runs (on a rank thread, no lock held) when a rank waited
  // kNewWorldPatience for a world that never came.
  WorldMailbox(std::string job_id, int64_t first_epoch, std::vector<int> local_ranks,
               std::function<void(const std::string&)> give_up);

  // The agent halted world `epoch` (the newest halted is kept).
  void halt(int64_t epoch);
  // The newest world the agent halted (-1: none).
  int64_t halted_epoch() const { return halted_epoch_.load(); }
  // The world the ranks move to: makes its hub. Throws rpc::RpcError naming an
  // epoch that is not newer, or a rank of this node the world has no place for.
  void post(const v1::NewWorld& next);
  // Ranks: the world after `epoch` once the agent sent it; nullopt once close()d,
  // or when none came within kNewWorldPatience (the agent decides within its halt
  // timeout, or fails the job: it never came back, or this node was left behind
  // and never heard).
  std::optional<v1::NewWorld> next_after(int64_t epoch);
  static constexpr std::chrono::seconds kNewWorldPatience{60};
  // The job stops: waiting ranks return nullopt.
  void close();
  // The in-process hub of this node's ranks in world `epoch`.
  std::shared_ptr<transport::LocalHub> hub(int64_t epoch);

 private:
  const std::string job_id_;
  const int64_t first_epoch_;
  const std::function<void(const std::string&)> give_up_;
  std::atomic<int64_t> halted_epoch_{-1};
  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;                                            // guarded by mu_
  std::map<int64_t, std::shared_ptr<transport::LocalHub>> hubs_;  // by world epoch, guarded by mu_
  std::vector<int> local_ranks_;                                   // in the newest world, guarded by mu_
  std::optional<v1::NewWorld> next_;                               // guarded by mu_
};

}  // namespace moe::node
