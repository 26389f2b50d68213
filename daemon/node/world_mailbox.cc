#include "moe/node/world_mailbox.h"

#include "moe/base/log.h"
#include "moe/base/check.h"
#include "moe/rpc/frame.h"

namespace moe::node {

WorldMailbox::WorldMailbox(std::string job_id, int64_t first_epoch, std::vector<int> local_ranks,
                           std::function<void(const std::string&)> give_up)
    : job_id_(std::move(job_id)), first_epoch_(first_epoch), give_up_(std::move(give_up)),
      local_ranks_(std::move(local_ranks)) {
  hubs_[first_epoch_] = std::make_shared<transport::LocalHub>(local_ranks_);
}

void WorldMailbox::halt(int64_t epoch) {
  int64_t seen = halted_epoch_.load();
  while (seen < epoch && !halted_epoch_.compare_exchange_weak(seen, epoch)) {
  }
}

void WorldMailbox::post(const v1::NewWorld& next) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t newest = next_ ? next_->world_epoch() : first_epoch_;
  if (next.world_epoch() <= newest)
    throw rpc::RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "job " + job_id_ + ": world " +
                                                                std::to_string(next.world_epoch()) + " is not newer than " +
                                                                std::to_string(newest));
  std::vector<int> ranks;
  for (int r : local_ranks_) {
    if (r < 0 || r >= next.new_rank_size() || next.new_rank(r) < 0 || next.new_rank(r) >= next.world_size())
      throw rpc::RpcError(v1::ERROR_CODE_INVALID_ARGUMENT, "job " + job_id_ + ": world " +
                                                               std::to_string(next.world_epoch()) + " has no rank for rank " +
                                                               std::to_string(r) + " of this node");
    ranks.push_back(next.new_rank(r));
  }
  local_ranks_ = ranks;
  hubs_[next.world_epoch()] = std::make_shared<transport::LocalHub>(ranks);
  next_ = next;
  log::info("job ", job_id_, ": world ", next.world_epoch(), " of ", next.world_size(), " ranks from step ",
            next.resume_step());
  cv_.notify_all();
}

std::optional<v1::NewWorld> WorldMailbox::next_after(int64_t epoch) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool told =
      cv_.wait_for(lock, kNewWorldPatience, [&] { return closed_ || (next_ && next_->world_epoch() > epoch); });
  if (next_ && next_->world_epoch() > epoch && !closed_) return next_;
  lock.unlock();
  if (!told)  // the agent never decided: the job ends here rather than wait forever
    give_up_("no new world within " + std::to_string(kNewWorldPatience.count()) + " s of world " +
             std::to_string(epoch) + "'s halt");
  return std::nullopt;
}

void WorldMailbox::close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  cv_.notify_all();
}

std::shared_ptr<transport::LocalHub> WorldMailbox::hub(int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = hubs_.find(epoch);
  MOE_CHECK(it != hubs_.end(), "job ", job_id_, ": no world ", epoch, " on this node");
  return it->second;
}

}  // namespace moe::node
