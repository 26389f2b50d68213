// moe-test-worker: the rank side of multi-process tests. Each subcommand runs one
// rank and prints a last line "RESULT ok" or "RESULT error peer=P <message>".
//   a2a --rank R --size N --port P [--iters I] [--bytes B] [--kill-at K]
//       all-to-alls of B bytes per peer; the rank raises SIGKILL before round K.
//   late-post --rank R --port P
//       3 ranks: one all-to-all, then rank 2 dies; ranks 0 and 1 exchange
//       messages until rank 0's transport has seen rank 2 fail, then all-reduce,
//       which posts to the dead rank only after its failure is known.
//   ep --case CASE --rank R --port P --out FILE
//       one EP test case (ep_harness.h) over UCX; the rank's results go to FILE.
#include <CLI/CLI.hpp>
#include <signal.h>

#include <functional>
#include <thread>
#include <iostream>

#include "ep_harness.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/transport/bootstrap.h"
#include "moe/transport/ucx_communicator.h"

using namespace moe::transport;

int main(int argc, char** argv) {
  CLI::App app{"moe-test-worker"};
  app.require_subcommand(1);
  int rank = 0, size = 1, port = 0, iters = 100, kill_at = -1;
  size_t bytes = 4096;
  CLI::App* a2a = app.add_subcommand("a2a", "all-to-all rounds over UCX");
  a2a->add_option("--rank", rank)->required();
  a2a->add_option("--size", size)->required();
  a2a->add_option("--port", port)->required();
  a2a->add_option("--iters", iters);
  a2a->add_option("--bytes", bytes);
  a2a->add_option("--kill-at", kill_at);
  CLI::App* late = app.add_subcommand("late-post", "post to a peer already known dead");
  late->add_option("--rank", rank)->required();
  late->add_option("--port", port)->required();
  std::string case_str, out_path;
  CLI::App* ep = app.add_subcommand("ep", "one EP case over UCX");
  ep->add_option("--case", case_str)->required();
  ep->add_option("--rank", rank)->required();
  ep->add_option("--port", port)->required();
  ep->add_option("--out", out_path)->required();
  CLI11_PARSE(app, argc, argv);

  // Runs one rank's body; prints the RESULT line the tests read.
  auto run = [](const std::function<void()>& body) {
    try {
      body();
      std::cout << "RESULT ok" << std::endl;
      return 0;
    } catch (const TransportError& e) {
      std::cout << "RESULT error peer=" << e.peer() << " " << e.what() << std::endl;
    } catch (const std::exception& e) {
      std::cout << "RESULT error peer=-1 " << e.what() << std::endl;
    }
    return 1;
  };
  if (*ep)
    return run([&] {
      const moe::test::EpCase c = moe::test::EpCase::decode(case_str);
      TcpBootstrap boot("127.0.0.1", port, rank, c.ranks);
      UcxCommunicator comm(rank, c.ranks, boot);
      moe::kernels::ThreadPool pool(1);
      auto be = moe::kernels::make_cpu_backend(pool);
      moe::test::run_rank(c, comm, *be).save(out_path);
      comm.barrier(deadline_in(std::chrono::seconds(30)));
    });
  if (*late)
    return run([&] {
      TcpBootstrap boot("127.0.0.1", port, rank, 3);
      UcxCommunicator comm(rank, 3, boot);
      const Segments segs = Segments::packed(std::vector<size_t>(3, 64));
      std::vector<uint8_t> send(3 * 64), recv(3 * 64);
      comm.all_to_all_v(send.data(), segs, recv.data(), segs, deadline_in(std::chrono::seconds(30)));
      if (rank == 2) ::raise(SIGKILL);
      int32_t ping = 0;
      for (int i = 0; i < 200; ++i) {  // about 2 s of progress on the live pair
        if (rank == 0) comm.send(1, &ping, sizeof ping, 7, deadline_in(std::chrono::seconds(30)));
        else comm.recv(0, &ping, sizeof ping, 7, deadline_in(std::chrono::seconds(30)));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      float x = 1.0f;
      comm.all_reduce_sum(&x, 1, deadline_in(std::chrono::seconds(30)));
    });
  return run([&] {
    TcpBootstrap boot("127.0.0.1", port, rank, size);
    UcxCommunicator comm(rank, size, boot);
    std::vector<uint8_t> send(size * bytes, static_cast<uint8_t>(rank)), recv(size * bytes);
    const Segments segs = Segments::packed(std::vector<size_t>(size, bytes));
    for (int i = 0; i < iters; ++i) {
      if (i == kill_at) ::raise(SIGKILL);
      comm.all_to_all_v(send.data(), segs, recv.data(), segs, deadline_in(std::chrono::seconds(30)));
      for (int r = 0; r < size; ++r)
        if (recv[r * bytes] != r) throw TransportError(r, "wrong payload from rank " + std::to_string(r));
    }
    comm.barrier(deadline_in(std::chrono::seconds(30)));
  });
}
