#include "moe/node/agent_bootstrap.h"

#include <chrono>
#include <thread>

namespace moe::node {

// An agent away (restarting on its state) is waited for, up to 60 s: the
// restarted one collects the world's addresses again.
std::vector<std::string> AgentBootstrap::all_gather(const std::string& mine) {
  v1::Envelope req;
  auto* p = req.mutable_bootstrap_publish();
  p->set_job_id(job_id_);
  p->set_rank(rank_);
  p->set_blob(mine);
  p->set_world_epoch(world_epoch_);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    try {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      const v1::Envelope reply = agent_.call(req, std::max(left, std::chrono::milliseconds(1)));
      return {reply.bootstrap_addresses().blobs().begin(), reply.bootstrap_addresses().blobs().end()};
    } catch (const rpc::RpcError& e) {
      if (e.code() == v1::ERROR_CODE_UNAVAILABLE && std::chrono::steady_clock::now() + std::chrono::milliseconds(200) < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the agent's restart
        continue;
      }
      throw rpc::RpcError(e.code(), std::string("transport bootstrap through the agent: ") + e.what());
    }
  }
}

}  // namespace moe::node
