#include "moe/node/rebalance_mailbox.h"

#include <sstream>

#include "moe/base/check.h"

namespace moe::node {

FaultInjection FaultInjection::parse(const std::string& spec, const std::string& node) {
  FaultInjection f;
  std::stringstream in(spec);
  for (std::string item; std::getline(in, item, ',');) {
    if (item.empty()) continue;
    const auto colon = item.find(':');
    MOE_CHECK(colon != std::string::npos, "MOE_FAULT_INJECT: expects NODE:FAULT, got '", item, "'");
    if (item.substr(0, colon) != node) continue;
    const std::string fault = item.substr(colon + 1);
    if (fault == "refuse-copy") f.refuse_copy = true;
    else if (fault == "stall-copy") f.stall_copy = true;
    else MOE_CHECK(false, "MOE_FAULT_INJECT: unknown fault '", fault, "' (refuse-copy, stall-copy)");
  }
  return f;
}

void RebalanceMailbox::prepare(const v1::PrepareRebalance& p) {
  std::lock_guard<std::mutex> lock(mu_);
  prepare_ = p;
}

void RebalanceMailbox::commit(int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  committed_ = epoch;
}

void RebalanceMailbox::abort(int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  aborted_ = epoch;
  if (prepare_ && prepare_->epoch() == epoch) prepare_.reset();
}

RebalanceMailbox::View RebalanceMailbox::view() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {prepare_, committed_, aborted_};
}

bool RebalanceMailbox::rank_ready(int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ready_epoch_ != epoch) {
    ready_epoch_ = epoch;
    ready_ranks_ = 0;
  }
  return ++ready_ranks_ == local_ranks_;
}

bool RebalanceMailbox::claim_refusal(int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (refused_epoch_ == epoch) return false;
  refused_epoch_ = epoch;
  return true;
}

void RebalanceMailbox::done(int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (prepare_ && prepare_->epoch() == epoch) prepare_.reset();
}

}  // namespace moe::node
