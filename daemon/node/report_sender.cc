#include "moe/node/report_sender.h"

#include "moe/base/log.h"

namespace moe::node {

namespace {

constexpr auto kRetryInterval = std::chrono::milliseconds(100);
constexpr auto kCallTimeout = std::chrono::seconds(10);

}  // namespace

ReportSender::ReportSender(rpc::ClientOptions agent, AgentLink& link, std::string job_id, int local_ranks)
    : agent_(std::move(agent)),
      link_(link),
      job_id_(std::move(job_id)),
      local_ranks_(local_ranks),
      under_(link.incarnation()),
      registrations_(link.registrations()) {
  thread_ = std::thread([this] { run(); });
}

ReportSender::~ReportSender() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ReportSender::send(v1::Envelope msg) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    dones_ += msg.has_rank_done();
    log_.push_back(std::move(msg));
  }
  cv_.notify_all();
}

bool ReportSender::settled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return settled_;
}

void ReportSender::flush(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, deadline, [&] { return settled_ || failing_ || next_ == log_.size(); });
}

void ReportSender::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    // A new registration (the agent restarted, or forgot us): all again, in order.
    if (const int64_t registered = link_.incarnation(); registered != under_) {
      if (next_ > 0 || unregistered_ != 0)
        log::info("job ", job_id_, ": the agent is incarnation ", registered, " now; re-sending ", log_.size(),
                  " report(s)");
      under_ = registered;
      unregistered_ = 0;
      next_ = 0;
    }
    // Registered again under the same incarnation (the agent declared us dead
    // and took us back): it counts this node busy with the job until every
    // local RankDone reaches it again.
    if (const int64_t n = link_.registrations(); n != registrations_) {
      if (settled_ || next_ > 0) {
        settled_ = false;
        next_ = 0;
      }
      registrations_ = n;
    }
    if (settled_) {  // nothing is needed unless the agent takes us back
      cv_.wait_for(lock, kRetryInterval);
      continue;
    }
    const bool waiting = next_ == log_.size() || unregistered_ != 0 || (failing_ && Clock::now() < retry_at_);
    if (waiting) {
      // New messages wake us; a registration or a retry is polled for.
      cv_.wait_for(lock, kRetryInterval);
      continue;
    }
    if (ended_ && !log_[next_].has_rank_done()) {
      ++next_;  // moot: the agent has the job's end
    } else {
      failing_ = !deliver_next(lock);
    }
    settled_ = ended_ && dones_ == local_ranks_ && next_ == log_.size();
    cv_.notify_all();  // flush
  }
}

bool ReportSender::deliver_next(std::unique_lock<std::mutex>& lock) {
  const v1::Envelope msg = log_[next_];
  const int64_t under = under_;
  lock.unlock();
  v1::Envelope reply;
  std::string error;
  try {
    reply = agent_.call(msg, kCallTimeout);
  } catch (const std::exception& e) {
    error = e.what();
  }
  lock.lock();
  if (!error.empty()) {
    link_.unreachable(Clock::now());
    if (!failing_) log::warn("job ", job_id_, ": holding its reports, the agent is unreachable: ", error);
    retry_at_ = Clock::now() + kRetryInterval;
    next_ = 0;  // whatever may have been lost: all again once it answers
    return false;
  }
  link_.reached();
  if (failing_) log::info("job ", job_id_, ": the agent answers again");
  const v1::ReportAck& ack = reply.report_ack();
  if (under_ != under) return true;  // re-registered meanwhile: the loop starts over
  if (ack.agent_incarnation() != under) {
    // An agent we have not registered with: the heartbeat thread re-registers,
    // then everything goes again.
    unregistered_ = ack.agent_incarnation();
    return true;
  }
  ++next_;
  ended_ = ended_ || ack.job_ended();
  return true;
}

}  // namespace moe::node
