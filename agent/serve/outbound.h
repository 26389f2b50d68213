// Calls from the agent to daemons, off the io thread: blocking RPC calls run on
// one worker thread, one at a time, in the order they were posted. A task that
// must touch agent state posts it back to the io thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "moe/rpc/client.h"

namespace moe::agent {

class Outbound {
 public:
  Outbound(std::string token, rpc::TlsFiles tls);
  ~Outbound();  // drops tasks not yet run and joins the worker
  Outbound(const Outbound&) = delete;
  Outbound& operator=(const Outbound&) = delete;

  // Runs task(client of `address`) on the worker thread.
  void post(const std::string& address, std::function<void(rpc::RpcClient&)> task);

 private:
  void loop();
  rpc::RpcClient& client(const std::string& address);  // worker thread only

  const std::string token_;
  const rpc::TlsFiles tls_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::map<std::string, std::unique_ptr<rpc::RpcClient>> clients_;  // worker thread only
  std::thread thread_;
};

}  // namespace moe::agent
