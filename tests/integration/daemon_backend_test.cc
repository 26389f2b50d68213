// moed runs its jobs on the backend its factory makes, and registers what it
// runs (docs/backends.md): an agent and a daemon in one process, over real RPC on
// loopback, with a factory of the test's own that counts the backends it makes.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>

#include "moe/agent/agent.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/node/daemon.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;

// An io_context on a thread of its own, joined by the destructor.
struct IoThread {
  rpc::asio::io_context io;
  std::thread thread;
  void start() {
    thread = std::thread([this] {
      auto guard = rpc::asio::make_work_guard(io);
      io.run();
    });
  }
  ~IoThread() {
    io.stop();
    if (thread.joinable()) thread.join();
  }
};

TEST(DaemonBackend, JobsRunOnTheFactorysBackendAndRegistrationNamesIt) {
  IoThread agent_io, daemon_io;
  agent::Agent agent(agent_io.io, {});
  agent_io.start();
  std::atomic<int> made{0};
  std::string engine;
  node::DaemonOptions o;
  o.agent = agent.address();
  o.name = "node0";
  o.devices = 2;
  o.threads = 2;
  o.backend = "cpu";  // the factory's kind, also where a GPU is visible
  std::mutex mu;
  std::set<int> devices;
  o.make_backend = [&](kernels::ThreadPool& pool, int device) {
    ++made;
    {
      std::lock_guard<std::mutex> lock(mu);
      devices.insert(device);
    }
    auto be = kernels::make_cpu_backend(pool);
    engine = be->gemm_engine();
    return be;
  };
  std::unique_ptr<node::Daemon> daemon;
  rpc::asio::post(daemon_io.io, [&] { daemon = std::make_unique<node::Daemon>(daemon_io.io, o); });
  daemon_io.start();

  rpc::RpcClient ctl(rpc::ClientOptions::make(agent.address(), "", "test", "test"));
  v1::Envelope status;
  status.mutable_cluster_status();
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (ctl.call(status, 5s).cluster_status_reply().nodes_size() < 1 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(20ms);  // polling for the registration
  const v1::ClusterStatus st = ctl.call(status, 5s).cluster_status_reply();
  ASSERT_EQ(st.nodes_size(), 1);
  EXPECT_EQ(st.nodes(0).backend(), v1::BACKEND_CPU);
  EXPECT_EQ(st.nodes(0).gemm_engine(), engine);
  // One device name per rank: here the CPU's model, twice.
  ASSERT_EQ(st.nodes(0).device_names_size(), 2);
  EXPECT_EQ(st.nodes(0).device_names(0), kernels::cpu_backend_info().cpu_model);
  EXPECT_EQ(st.nodes(0).device_names(1), st.nodes(0).device_names(0));
  const int probes = made.load();  // the daemon asked one backend what it is
  EXPECT_EQ(probes, 1);

  v1::Envelope submit;
  auto* spec = submit.mutable_submit_job()->mutable_spec();
  spec->set_experts(4);
  spec->set_top_k(2);
  spec->set_hidden(16);
  spec->set_ffn_hidden(8);
  spec->set_tokens_per_rank(8);
  spec->set_steps(2);
  const std::string id = ctl.call(submit, 5s).job().job_id();
  v1::Envelope wait;
  wait.mutable_wait_job()->set_job_id(id);
  v1::JobResult r;
  for (int i = 0; i < 10 && r.state() != v1::JOB_STATE_SUCCEEDED && r.state() != v1::JOB_STATE_FAILED; ++i)
    r = ctl.call(wait, 30s).job();
  EXPECT_EQ(r.state(), v1::JOB_STATE_SUCCEEDED) << r.message();
  EXPECT_EQ(made.load(), probes + 2) << "one backend per rank, from the daemon's factory";
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(devices, (std::set<int>{0, 1})) << "each rank's backend on its own device";
  }

  // Stop the io threads first; then nothing runs beside the teardown.
  daemon_io.io.stop();
  daemon_io.thread.join();
  daemon.reset();
  agent_io.io.stop();
  agent_io.thread.join();
}

}  // namespace
}  // namespace moe::test
