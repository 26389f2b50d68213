// moe-test-worker: the rank side of multi-process tests. Each subcommand runs one
// rank and prints a last line "RESULT ok" or "RESULT error peer=P <message>".
//   a2a --rank R --size N --port P [--iters I] [--bytes B] [--kill-at K]
//       all-to-alls of B bytes per peer; the rank raises SIGKILL before round K.
//   ep --case CASE --rank R --port P --out FILE
//       one EP test case (ep_harness.h) over UCX; the rank's results go to FILE.
#include <CLI/CLI.hpp>
#include <signal.h>

#include <functional>
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
