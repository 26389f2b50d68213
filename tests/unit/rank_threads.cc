#include "rank_threads.h"

#include <chrono>
#include <memory>
#include <thread>

#include "moe/transport/bootstrap.h"
#include "moe/transport/transport_factory.h"

namespace moe::test {

using namespace moe::transport;

std::vector<std::string> run_ranks(Kind kind, int R, const std::function<void(Communicator&)>& body,
                                   size_t* hub_pending) {
  std::vector<std::string> errors(R);
  std::vector<std::thread> threads;
  std::unique_ptr<TcpRendezvousServer> server;
  if (kind != Kind::kInProc) server = std::make_unique<TcpRendezvousServer>(R, std::chrono::seconds(30));
  // The ranks' processes as the transport factory sees them: one (in-process),
  // one per rank (UCX), or two halves (UCX between, the hub inside).
  std::vector<int> all, first_half, second_half;
  for (int r = 0; r < R; ++r) {
    all.push_back(r);
    (r < (R + 1) / 2 ? first_half : second_half).push_back(r);
  }
  auto hub_all = std::make_shared<LocalHub>(all);
  auto hub_a = std::make_shared<LocalHub>(first_half), hub_b = std::make_shared<LocalHub>(second_half);
  auto hub_of = [&](int r) -> std::shared_ptr<LocalHub> {
    switch (kind) {
      case Kind::kInProc: return hub_all;
      case Kind::kUcx: return nullptr;
      case Kind::kHybrid: return hub_a->is_local(r) ? hub_a : hub_b;
    }
    return nullptr;
  };
  for (int r = 0; r < R; ++r)
    threads.emplace_back([&, r] {
      try {
        std::unique_ptr<TcpBootstrap> boot;
        if (server) boot = std::make_unique<TcpBootstrap>("127.0.0.1", server->port(), r, R);
        RankTransports t = make_rank_transports({.rank = r, .world = R, .local = hub_of(r), .bootstrap = boot.get()});
        body(*t.host);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (hub_of(r)) hub_of(r)->abort(r, e.what());
      }
    });
  for (auto& t : threads) t.join();
  if (server) server->wait();
  if (hub_pending) *hub_pending = hub_a->pending() + hub_b->pending() + hub_all->pending();
  return errors;
}

}  // namespace moe::test
