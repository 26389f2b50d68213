#include "rank_threads.h"

#include <chrono>
#include <memory>
#include <thread>

#include "moe/transport/bootstrap.h"
#include "moe/transport/inproc_communicator.h"
#include "moe/transport/ucx_communicator.h"

namespace moe::test {

using namespace moe::transport;

std::vector<std::string> run_ranks(Kind kind, int R, const std::function<void(Communicator&)>& body,
                                   size_t* hub_pending) {
  std::vector<std::string> errors(R);
  std::vector<std::thread> threads;
  InProcGroup group(R);
  std::unique_ptr<TcpRendezvousServer> server;
  if (kind != Kind::kInProc) server = std::make_unique<TcpRendezvousServer>(R, std::chrono::seconds(30));
  std::vector<int> first_half, second_half;
  for (int r = 0; r < R; ++r) (r < (R + 1) / 2 ? first_half : second_half).push_back(r);
  auto hub_a = std::make_shared<LocalHub>(first_half), hub_b = std::make_shared<LocalHub>(second_half);
  for (int r = 0; r < R; ++r)
    threads.emplace_back([&, r] {
      try {
        std::unique_ptr<Communicator> comm;
        if (kind == Kind::kInProc) {
          comm = group.communicator(r);
        } else {
          TcpBootstrap boot("127.0.0.1", server->port(), r, R);
          UcxOptions o;
          if (kind == Kind::kHybrid) o.hub = hub_a->is_local(r) ? hub_a : hub_b;
          comm = std::make_unique<UcxCommunicator>(r, R, boot, o);
        }
        body(*comm);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (kind == Kind::kInProc) group.abort(r, e.what());
        if (kind == Kind::kHybrid) (hub_a->is_local(r) ? hub_a : hub_b)->abort(r, e.what());
      }
    });
  for (auto& t : threads) t.join();
  if (server) server->wait();
  if (hub_pending) *hub_pending = hub_a->pending() + hub_b->pending();
  return errors;
}

}  // namespace moe::test
