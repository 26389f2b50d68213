// moe-bench ep: the expert-parallel layer across R ranks (threads over the
// in-process transport, or processes over UCX on loopback), and in the same run the
// bandwidth of a 2-process ucx_perftest in PEER error mode (-e) with the same
// environment and message size.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "benches.h"
#include "moe/ep/ep_layer.h"
#include "moe/base/check.h"
#include "moe/base/clock.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/transport/bootstrap.h"
#include "moe/transport/transport_factory.h"

namespace moe::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Runs a child, returns its stdout; empty on failure.
std::string capture(const std::vector<std::string>& argv, Clock::duration timeout, pid_t* started = nullptr) {
  int fds[2];
  if (::pipe(fds) != 0) return "";
  const pid_t pid = ::fork();
  if (pid < 0) return "";
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    ::close(fds[1]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  ::close(fds[1]);
  if (started) {
    *started = pid;
    ::close(fds[0]);
    return "";
  }
  std::string out;
  char buf[4096];
  const auto until = Clock::now() + timeout;
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, n);
    if (Clock::now() > until) break;
  }
  ::close(fds[0]);
  ::waitpid(pid, nullptr, 0);
  return out;
}

// "Final: ... bw_avg bw_overall ..." of ucx_perftest; MB/s of 2^20 bytes -> GB/s.
double parse_perftest_gbps(const std::string& out) {
  const auto pos = out.find("Final:");
  if (pos == std::string::npos) return 0;
  std::istringstream in(out.substr(pos + 6));
  double f[6] = {};
  for (double& v : f) in >> v;
  return f[5] * 1048576.0 / 1e9;
}

// An ephemeral port that was free a moment ago (ucx_perftest takes a port number).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  int port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
    port = ntohs(addr.sin_port);
  if (fd >= 0) ::close(fd);
  return port;
}

}  // namespace

EpRankStats run_ep_rank(const EpBenchOptions& o, transport::Communicator& comm) {
  MOE_CHECK(o.experts % o.ranks == 0, "--experts (", o.experts, ") must be divisible by --ranks (", o.ranks, ")");
  kernels::ThreadPool pool(o.threads);
  auto be = kernels::make_cpu_backend(pool);
  const int rank = comm.rank();
  const ep::MoeLayerConfig cfg = ep::layer_config({.experts = o.experts,
                                                    .top_k = o.top_k,
                                                    .hidden = o.hidden,
                                                    .ffn_hidden = o.ffn,
                                                    .dtype = o.dtype,
                                                    .tokens_per_rank = o.tokens,
                                                    .train = true});
  const moe::ExpertMap map = moe::ExpertMap::contiguous(o.experts, o.ranks);
  ep::EpOptions eopts;
  eopts.isolate_transport_timing = true;
  ep::EpLayer layer(cfg, map, comm, *be, eopts);
  layer.set_weights(model::make_layer_weights(o.seed, 0, {o.hidden, o.ffn, o.experts}, map.hosted(rank)));

  const int64_t T = o.tokens, begin = rank * T;
  std::vector<float> x32(T * o.hidden), g32(T * o.hidden);
  model::fill_inputs(o.seed, 0, begin, T, o.hidden, x32.data());
  model::fill_inputs(o.seed ^ 0x67726164ull, 0, begin, T, o.hidden, g32.data());
  const auto x = model::to_storage(x32, o.dtype), go = model::to_storage(g32, o.dtype);
  std::vector<uint8_t> out(x.size()), gx(x.size());

  EpRankStats st;
  std::vector<double> fwd, train, disp, comb;
  for (int i = 0; i < o.warmup + o.iters; ++i) {
    comm.barrier(transport::deadline_in(std::chrono::seconds(60)));
    const double t0 = now_seconds();
    layer.forward(x.data(), T, begin, out.data());
    const double t1 = now_seconds();
    if (i < o.warmup) continue;
    fwd.push_back(t1 - t0);
    disp.push_back(layer.stats().transfer.dispatch_transport);
    comb.push_back(layer.stats().transfer.combine_transport);
  }
  st.dispatch_bytes = layer.stats().transfer.dispatch_bytes;
  st.combine_bytes = layer.stats().transfer.combine_bytes;
  st.naive_dispatch_bytes = layer.stats().transfer.naive_dispatch_bytes;
  for (int i = 0; i < o.iters; ++i) {
    comm.barrier(transport::deadline_in(std::chrono::seconds(60)));
    const double t0 = now_seconds();
    layer.forward(x.data(), T, begin, out.data());
    layer.backward(go.data(), gx.data());
    train.push_back(now_seconds() - t0);
  }
  st.forward_seconds = median(fwd);
  st.train_seconds = median(train);
  st.dispatch_seconds = median(disp);
  st.combine_seconds = median(comb);
  return st;
}

std::string EpRankStats::encode() const {
  std::ostringstream os;
  os.precision(17);
  os << "RANKSTATS forward_seconds=" << forward_seconds << " train_seconds=" << train_seconds
     << " dispatch_seconds=" << dispatch_seconds << " combine_seconds=" << combine_seconds
     << " dispatch_bytes=" << dispatch_bytes << " combine_bytes=" << combine_bytes
     << " naive_dispatch_bytes=" << naive_dispatch_bytes;
  return os.str();
}

EpRankStats EpRankStats::decode(const std::string& text) {
  const auto pos = text.find("RANKSTATS ");
  MOE_CHECK(pos != std::string::npos, "ep bench: a rank printed no statistics:\n", text);
  std::istringstream in(text.substr(pos + 10));
  std::map<std::string, double> kv;
  std::string item;
  while (in >> item) {
    const auto eq = item.find('=');
    if (eq != std::string::npos) kv[item.substr(0, eq)] = std::stod(item.substr(eq + 1));
  }
  EpRankStats s;
  s.forward_seconds = kv["forward_seconds"];
  s.train_seconds = kv["train_seconds"];
  s.dispatch_seconds = kv["dispatch_seconds"];
  s.combine_seconds = kv["combine_seconds"];
  s.dispatch_bytes = static_cast<int64_t>(kv["dispatch_bytes"]);
  s.combine_bytes = static_cast<int64_t>(kv["combine_bytes"]);
  s.naive_dispatch_bytes = static_cast<int64_t>(kv["naive_dispatch_bytes"]);
  return s;
}

Report run_ep_bench(const EpBenchOptions& o, const std::string& self_exe) {
  MOE_CHECK(o.ranks >= 1, "--ranks must be >= 1, got ", o.ranks);
  MOE_CHECK(o.transport == "ucx" || o.transport == "inproc", "--transport must be ucx or inproc, got '", o.transport,
            "'");
  MOE_CHECK(o.experts % o.ranks == 0, "--experts (", o.experts, ") must be divisible by --ranks (", o.ranks, ")");
  std::vector<EpRankStats> stats(o.ranks);
  if (o.transport == "inproc") {
    // Every rank a thread of this process: the transport factory's in-process case.
    std::vector<int> all(o.ranks);
    for (int r = 0; r < o.ranks; ++r) all[r] = r;
    const auto hub = std::make_shared<transport::LocalHub>(all);
    std::vector<std::string> errors(o.ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < o.ranks; ++r)
      threads.emplace_back([&, r] {
        try {
          const transport::RankTransports t =
              transport::make_rank_transports({.rank = r, .world = o.ranks, .local = hub});
          stats[r] = run_ep_rank(o, *t.host);
        } catch (const std::exception& e) {
          errors[r] = e.what();
          hub->abort(r, e.what());
        }
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < o.ranks; ++r) MOE_CHECK(errors[r].empty(), "rank ", r, ": ", errors[r]);
  } else {
    transport::TcpRendezvousServer server(o.ranks, std::chrono::seconds(120));
    std::vector<int> pipes(o.ranks);
    std::vector<pid_t> pids(o.ranks);
    for (int r = 0; r < o.ranks; ++r) {
      int fds[2];
      MOE_CHECK(::pipe(fds) == 0, "ep bench: pipe failed");
      pids[r] = ::fork();
      MOE_CHECK(pids[r] >= 0, "ep bench: fork failed");
      if (pids[r] == 0) {
        ::dup2(fds[1], 1);
        ::close(fds[0]);
        ::close(fds[1]);
        std::vector<std::string> a = {self_exe, "ep-rank", "--rank", std::to_string(r), "--port",
                                      std::to_string(server.port())};
        for (const auto& extra : o.rank_args()) a.push_back(extra);
        std::vector<char*> args;
        for (auto& s : a) args.push_back(s.data());
        args.push_back(nullptr);
        ::execv(args[0], args.data());
        ::_exit(127);
      }
      ::close(fds[1]);
      pipes[r] = fds[0];
    }
    for (int r = 0; r < o.ranks; ++r) {
      std::string text;
      char buf[4096];
      ssize_t n;
      while ((n = ::read(pipes[r], buf, sizeof buf)) > 0) text.append(buf, n);
      ::close(pipes[r]);
      int status = 0;
      ::waitpid(pids[r], &status, 0);
      MOE_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "ep bench: rank ", r, " failed:\n", text);
      stats[r] = EpRankStats::decode(text);
    }
    server.wait();
  }

  double fwd = 0, train = 0, disp = 0, comb = 0;
  int64_t dbytes = 0, cbytes = 0, naive = 0;
  for (const auto& s : stats) {
    fwd = std::max(fwd, s.forward_seconds);
    train = std::max(train, s.train_seconds);
    disp = std::max(disp, s.dispatch_seconds);
    comb = std::max(comb, s.combine_seconds);
    dbytes += s.dispatch_bytes;
    cbytes += s.combine_bytes;
    naive += s.naive_dispatch_bytes;
  }
  const double total_tokens = static_cast<double>(o.tokens) * o.ranks;
  const double dispatch_gbps = disp > 0 ? dbytes / disp / 1e9 : 0;
  const double combine_gbps = comb > 0 ? cbytes / comb / 1e9 : 0;
  const int64_t pairs = static_cast<int64_t>(o.ranks) * (o.ranks - 1);
  const int64_t segment = pairs > 0 ? dbytes / pairs : 0;

  Report r;
  r.add("bench", "ep");
  r.add("transport", o.transport);
  r.add("ranks", static_cast<int64_t>(o.ranks));
  r.add("threads_per_rank", static_cast<int64_t>(o.threads));
  r.add("tokens_per_rank", o.tokens).add("hidden", static_cast<int64_t>(o.hidden)).add("ffn", static_cast<int64_t>(o.ffn));
  r.add("experts", static_cast<int64_t>(o.experts)).add("top_k", static_cast<int64_t>(o.top_k));
  r.add("dtype", kernels::dtype_name(o.dtype));
  add_cpu_kernels(r, o.dtype);  // what every rank's backend runs
  r.add("forward_tokens_per_second", total_tokens / fwd);
  r.add("train_tokens_per_second", total_tokens / train);
  r.add("forward_step_seconds_p50", fwd);
  r.add("train_step_seconds_p50", train);
  r.add("dispatch_bytes", dbytes);
  r.add("naive_dispatch_bytes", naive);
  r.add("combine_bytes", cbytes);
  r.add("dispatch_over_naive", naive > 0 ? static_cast<double>(dbytes) / naive : 0.0);
  r.add("mean_segment_bytes", segment);
  r.add("dispatch_gbps", dispatch_gbps);
  r.add("combine_gbps", combine_gbps);
  if (o.transport == "ucx" && o.perftest && segment > 0) {
    const int port = free_port();
    pid_t server_pid = -1;
    capture({"ucx_perftest", "-p", std::to_string(port), "-e"}, std::chrono::seconds(60), &server_pid);
    std::string out;
    for (int attempt = 0; attempt < 50 && out.find("Final:") == std::string::npos; ++attempt) {
      // The server needs a moment to listen; the client fails fast until it does.
      out = capture({"ucx_perftest", "127.0.0.1", "-p", std::to_string(port), "-t", "tag_bw", "-s",
                     std::to_string(segment), "-n", "200", "-e"},
                    std::chrono::seconds(60));
      if (out.find("Final:") == std::string::npos) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (server_pid > 0) {
      ::kill(server_pid, SIGTERM);
      ::waitpid(server_pid, nullptr, 0);
    }
    const double perf = parse_perftest_gbps(out);
    Report& p = r.section("ucx_perftest");
    p.add("command", "ucx_perftest -t tag_bw -s " + std::to_string(segment) + " -n 200 -e (2 processes)");
    p.add("gbps", perf);
    p.add("dispatch_fraction", perf > 0 ? dispatch_gbps / perf : 0.0);
    p.add("combine_fraction", perf > 0 ? combine_gbps / perf : 0.0);
    if (perf == 0) p.add("error", "ucx_perftest did not report (is ucx-utils installed?)");
  }
  return r;
}

std::vector<std::string> EpBenchOptions::rank_args() const {
  return {"--ranks",  std::to_string(ranks),  "--tokens", std::to_string(tokens),  "--hidden",
          std::to_string(hidden), "--ffn", std::to_string(ffn), "--experts", std::to_string(experts),
          "--top-k", std::to_string(top_k), "--threads", std::to_string(threads), "--iters",
          std::to_string(iters), "--warmup", std::to_string(warmup), "--dtype", kernels::dtype_name(dtype),
          "--seed", std::to_string(seed)};
}

}  // namespace moe::bench
