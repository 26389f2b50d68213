#include "outbound.h"

namespace moe::agent {

Outbound::Outbound(std::string token, rpc::TlsFiles tls)
    : token_(std::move(token)), tls_(std::move(tls)), thread_([this] { loop(); }) {}

Outbound::~Outbound() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void Outbound::post(const std::string& address, std::function<void(rpc::RpcClient&)> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back([this, address, task = std::move(task)] { task(client(address)); });
  }
  cv_.notify_one();
}

rpc::RpcClient& Outbound::client(const std::string& address) {
  auto& c = clients_[address];
  if (!c) c = std::make_unique<rpc::RpcClient>(rpc::ClientOptions::make(address, token_, "moe-agent", "agent", tls_));
  return *c;
}

void Outbound::loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (stop_) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace moe::agent
