// Delivers one job's step reports and RankDones from a daemon's ranks to the
// agent, in the order the ranks sent them, from a thread of its own: steps never
// wait for the agent. It keeps every message of the job (they are small) until
// the agent says the job ended: whenever a call fails, or the agent answers
// with another incarnation than the daemon registered with (it restarted), it
// re-sends all of them in order once the agent answers again and the daemon has
// registered with it. The agent ignores what it already has (by step and rank).
// Once the agent says the job ended, only the RankDones still go (they free the
// node at the agent). Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "moe/node/agent_link.h"
#include "moe/rpc/client.h"

namespace moe::node {

class ReportSender {
 public:
  using Clock = std::chrono::steady_clock;

  // `link` outlives the sender; local_ranks RankDones will come.
  ReportSender(rpc::ClientOptions agent, AgentLink& link, std::string job_id, int local_ranks);
  ~ReportSender();  // stops; what was not delivered is dropped

  // Queues a step_report or rank_done envelope; never blocks on the agent.
  void send(v1::Envelope msg);
  // The agent recorded the job's end and has every local rank's RankDone:
  // nothing needs sending again.
  bool settled() const;
  // Waits until every message sent so far was delivered, the agent recorded the
  // job's end, a call failed, or the deadline.
  void flush(Clock::time_point deadline);

 private:
  void run();
  // Delivers log_[next_] with mu_ released; false when the call failed.
  bool deliver_next(std::unique_lock<std::mutex>& lock);

  rpc::RpcClient agent_;
  AgentLink& link_;
  const std::string job_id_;
  const int local_ranks_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<v1::Envelope> log_;  // every message, in the order sent
  int dones_ = 0;                  // RankDones in log_
  size_t next_ = 0;                // log_[0, next_) reached the agent of incarnation under_
  int64_t under_ = 0;
  int64_t registrations_ = 0;      // link_.registrations() when last looked at
  int64_t unregistered_ = 0;       // an incarnation the agent answered with that we have not registered with
  bool failing_ = false;           // the last call failed: retry at retry_at_
  Clock::time_point retry_at_;
  bool ended_ = false;    // the agent recorded the job's end: step reports are moot
  bool settled_ = false;  // ... and every RankDone reached it
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace moe::node
