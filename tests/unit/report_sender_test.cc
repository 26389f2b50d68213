// A daemon's ReportSender against a fake agent on loopback: reports arrive in
// order; an agent of another incarnation gets everything again, in order, only
// once the daemon registered with it; after a failed call everything goes again
// once the agent answers; the agent's "job ended" settles the sender.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "moe/node/report_sender.h"
#include "moe/rpc/server.h"

namespace moe::node {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// An agent that records "r<rank>s<step>" (or "r<rank>done") per message and
// answers with its incarnation; the job ends with the first RankDone.
class FakeAgent {
 public:
  FakeAgent(int port, int64_t incarnation) : incarnation_(incarnation) {
    rpc::ServerOptions o;
    o.port = port;
    o.role = "fake-agent";
    server_ = std::make_unique<rpc::RpcServer>(
        io_, o, [this](const v1::Envelope& req, const rpc::RequestContext&) -> rpc::awaitable<v1::Envelope> {
          v1::Envelope reply;
          std::lock_guard<std::mutex> lock(mu_);
          if (req.has_step_report())
            got_.push_back("r" + std::to_string(req.step_report().rank()) + "s" +
                           std::to_string(req.step_report().stats().step()));
          if (req.has_rank_done()) got_.push_back("r" + std::to_string(req.rank_done().rank()) + "done");
          reply.mutable_report_ack()->set_agent_incarnation(incarnation_);
          reply.mutable_report_ack()->set_job_ended(req.has_rank_done());
          co_return reply;
        });
    thread_ = std::thread([this] {
      auto guard = rpc::asio::make_work_guard(io_);
      io_.run();
    });
  }
  ~FakeAgent() {
    rpc::asio::post(io_, [this] { server_->stop(); });
    io_.stop();
    thread_.join();
  }
  int port() const { return server_->port(); }
  std::vector<std::string> got() const {
    std::lock_guard<std::mutex> lock(mu_);
    return got_;
  }
  // Polls until `n` messages arrived (or 10 s) and returns them.
  std::vector<std::string> wait_for(size_t n) const {
    const auto until = Clock::now() + 10s;
    while (got().size() < n && Clock::now() < until) std::this_thread::sleep_for(5ms);  // polling the fake's log
    return got();
  }

 private:
  const int64_t incarnation_;
  rpc::asio::io_context io_;
  std::unique_ptr<rpc::RpcServer> server_;
  std::thread thread_;
  mutable std::mutex mu_;
  std::vector<std::string> got_;
};

v1::Envelope step(int rank, int s) {
  v1::Envelope e;
  e.mutable_step_report()->set_job_id("job-1");
  e.mutable_step_report()->set_rank(rank);
  e.mutable_step_report()->mutable_stats()->set_step(s);
  return e;
}

v1::Envelope done(int rank) {
  v1::Envelope e;
  e.mutable_rank_done()->set_job_id("job-1");
  e.mutable_rank_done()->set_rank(rank);
  e.mutable_rank_done()->set_ok(true);
  return e;
}

using Got = std::vector<std::string>;

TEST(ReportSender, ReSendsEverythingInOrderAfterARestartAndAFailure) {
  AgentLink link;
  link.registered(1);
  auto first = std::make_unique<FakeAgent>(0, 1);
  const int port = first->port();
  ReportSender sender(rpc::ClientOptions::make("127.0.0.1:" + std::to_string(port), "", "moed", "test"), link,
                      "job-1", 2);
  sender.send(step(0, 0));
  sender.send(step(1, 0));
  EXPECT_EQ(first->wait_for(2), (Got{"r0s0", "r1s0"}));

  // The agent restarts (incarnation 2) on the same address. The next report
  // meets the closed connection, so everything goes again: the first answer
  // shows the new incarnation, and nothing more goes until the daemon
  // registered with it.
  first.reset();
  FakeAgent second(port, 2);
  sender.send(step(0, 1));
  EXPECT_EQ(second.wait_for(1), (Got{"r0s0"}));
  sender.send(step(1, 1));
  link.registered(2);
  EXPECT_EQ(second.wait_for(5), (Got{"r0s0", "r0s0", "r1s0", "r0s1", "r1s1"}))
      << "r1s1 waited for the registration, then everything went in order";
  EXPECT_EQ(link.unreachable_for(Clock::now()), Clock::duration::zero());
  EXPECT_FALSE(sender.settled());
}

TEST(ReportSender, HoldsReportsWhileTheAgentIsAwayAndSettlesWhenTheJobEnded) {
  AgentLink link;
  link.registered(1);
  auto agent = std::make_unique<FakeAgent>(0, 1);
  const int port = agent->port();
  ReportSender sender(rpc::ClientOptions::make("127.0.0.1:" + std::to_string(port), "", "moed", "test"), link,
                      "job-1", 1);
  sender.send(step(0, 0));
  EXPECT_EQ(agent->wait_for(1), (Got{"r0s0"}));
  agent.reset();  // away: the steps go on, held
  sender.send(step(0, 1));
  sender.send(step(0, 2));
  const auto until = Clock::now() + 10s;
  while (link.unreachable_for(Clock::now()) == Clock::duration::zero() && Clock::now() < until)
    std::this_thread::sleep_for(5ms);  // polling the sender's first failed call
  EXPECT_GT(link.unreachable_for(Clock::now()), Clock::duration::zero());
  sender.flush(Clock::now() + 10s);  // returns on the failure, not at the deadline

  FakeAgent back(port, 1);  // the same agent answers again
  sender.send(done(0));
  EXPECT_EQ(back.wait_for(4), (Got{"r0s0", "r0s1", "r0s2", "r0done"}));
  sender.flush(Clock::now() + 10s);
  EXPECT_TRUE(sender.settled()) << "the agent has the job's end and the node's every RankDone";
}

}  // namespace
}  // namespace moe::node
