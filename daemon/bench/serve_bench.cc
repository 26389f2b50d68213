// moe-serve-bench: a serving job's calls (docs/serving.md) beside the in-process
// layer, in one run (figures, never pass/fail). Against a running serving job:
//   latency    sequential calls of one client at each batch size: p50, p99 and
//              mean, beside the in-process layer's forward (ep::MoeLayer, the
//              job's spec and layer-0 weights, --threads as the daemon's) at
//              the same batch, rounds interleaved; the bound is
//              p50 <= 1.1 x in-process p50 + 0.5 ms.
//              --compare-paths adds the same calls with their rows in the
//              call (framed) and on the tensor wire, interleaved.
//   throughput C clients (threads with a session each) calling batch B for a
//              while: rows/s, beside the in-process layer's rows/s at its best
//              batch (the largest latency batch).
// daemon/bench/serve_bench.sh starts a 1x1 cluster and the job, and runs it.
#include <CLI/CLI.hpp>
#include <malloc.h>

#include <atomic>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include "benches.h"
#include "moe/base/check.h"
#include "moe/base/clock.h"
#include "moe/client/session.h"
#include "moe/ep/moe_layer.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/layer_spec/job_layers.h"
#include "moe/model/synthetic.h"
#include "moe/rpc/local_access.h"
#include "report.h"

namespace moe::bench {
namespace {

struct Options {
  std::string job, agent, state_dir, token_file;
  std::vector<int64_t> batches = {1, 16, 128};
  std::vector<int> clients = {1, 2, 4, 8};
  int64_t client_batch = 16;
  int calls = 100;   // per batch and round
  int rounds = 3;    // in-process and served interleaved
  double seconds = 5;  // per client count
  int threads = 2;   // the in-process layer's (the daemon's --threads)
  bool malloc_tuning = true;  // keep large buffers, as moed does (docs/benchmarks.md#serving)
  size_t wire_min_bytes = client::SessionOptions::kWireMinBytes;  // the sessions' (docs/serving.md#data-path)
  bool compare_paths = false;  // latency also framed-only and wire-only, interleaved
};

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

client::SessionOptions session_options(const Options& o, const std::string& name,
                                       std::optional<size_t> wire_min_bytes = std::nullopt) {
  const rpc::LocalAccess local = rpc::local_access(o.state_dir.empty() ? rpc::default_state_dir() : o.state_dir);
  client::SessionOptions s;
  s.agent = o.agent.empty() ? local.agent : o.agent;
  s.token = o.token_file.empty() ? local.token : rpc::read_token_file(o.token_file);
  s.tls = local.tls;
  s.job = o.job;
  s.name = name;
  s.wire_min_bytes = wire_min_bytes.value_or(o.wire_min_bytes);
  return s;
}

// The job's rows: T rows of hidden size H in its dtype, seeded.
std::vector<uint8_t> rows_of(const v1::JobSpec& spec, int64_t T, uint64_t seed) {
  std::vector<float> x(T * spec.hidden());
  model::fill_inputs(seed, 0, 0, T, spec.hidden(), x.data());
  return model::to_storage(x, layer_spec::JobView(spec).dtype);
}

// Sequential calls' latency at each batch, beside the in-process layer's forward;
// returns the in-process rows/s at the last batch.
// One session's sequential calls at batch b: their seconds appended.
void time_calls(const Options& o, client::Session& s, const std::vector<uint8_t>& x, int64_t b, std::vector<double>& t) {
  for (int i = 0; i < o.calls; ++i) {
    const double t0 = now_seconds();
    s.forward_bytes(0, x.data(), b, s.spec().dtype());
    t.push_back(now_seconds() - t0);
  }
}

double latency(const Options& o, client::Session& s, ep::MoeLayer& layer, Report& r) {
  double last_rate = 0;
  Report& sec = r.section("latency");
  std::unique_ptr<client::Session> framed, wire;  // --compare-paths
  if (o.compare_paths) {
    framed = std::make_unique<client::Session>(session_options(o, "bench-framed", SIZE_MAX));
    wire = std::make_unique<client::Session>(session_options(o, "bench-wire", 0));
  }
  for (int64_t b : o.batches) {
    const std::vector<uint8_t> x = rows_of(s.spec(), b, 7 + b);
    std::vector<uint8_t> out(x.size());
    std::vector<double> served, local, by_framed, by_wire;
    for (int i = 0; i < 3; ++i) {  // warm every path
      layer.forward(x.data(), b, out.data());
      for (client::Session* c : {&s, framed.get(), wire.get()})
        if (c) c->forward_bytes(0, x.data(), b, s.spec().dtype());
    }
    for (int round = 0; round < o.rounds; ++round) {
      for (int i = 0; i < o.calls; ++i) {
        const double t0 = now_seconds();
        layer.forward(x.data(), b, out.data());
        local.push_back(now_seconds() - t0);
      }
      time_calls(o, s, x, b, served);
      if (framed) time_calls(o, *framed, x, b, by_framed);
      if (wire) time_calls(o, *wire, x, b, by_wire);
    }
    const double p50 = quantile(served, 0.5) * 1e3, local_p50 = quantile(local, 0.5) * 1e3;
    const double bound = 1.1 * local_p50 + 0.5;
    Report& e = sec.section("batch_" + std::to_string(b));
    e.add("calls", static_cast<int64_t>(served.size()));
    e.add("served_p50_ms", p50);
    e.add("served_p99_ms", quantile(served, 0.99) * 1e3);
    e.add("served_mean_ms", mean(served) * 1e3);
    e.add("in_process_p50_ms", local_p50);
    e.add("in_process_p99_ms", quantile(local, 0.99) * 1e3);
    e.add("served_over_in_process", local_p50 > 0 ? p50 / local_p50 : 0.0);
    e.add("bound_ms", bound);
    e.add("p50_within_bound", p50 <= bound);
    e.add("p99_within_2x_p50", quantile(served, 0.99) * 1e3 <= 2 * p50);
    last_rate = local_p50 > 0 ? static_cast<double>(b) / (local_p50 / 1e3) : 0.0;
    e.add("in_process_rows_per_s", last_rate);
    if (o.compare_paths) {
      e.add("framed_p50_ms", quantile(by_framed, 0.5) * 1e3);
      e.add("framed_p99_ms", quantile(by_framed, 0.99) * 1e3);
      e.add("wire_p50_ms", quantile(by_wire, 0.5) * 1e3);
      e.add("wire_p99_ms", quantile(by_wire, 0.99) * 1e3);
    }
  }
  return last_rate;
}

// C clients calling batch B for o.seconds: rows per second.
double client_rows_per_s(const Options& o, const v1::JobSpec& spec, int C, int64_t* failures) {
  std::atomic<int64_t> rows{0}, failed{0};
  std::atomic<bool> go{false}, stop{false};
  std::vector<std::thread> threads;
  for (int c = 0; c < C; ++c)
    threads.emplace_back([&, c] {
      try {
        client::Session s(session_options(o, "bench-client-" + std::to_string(c)));
        const std::vector<uint8_t> x = rows_of(spec, o.client_batch, 100 + c);
        while (!go) std::this_thread::yield();  // every session connected first
        while (!stop) {
          s.forward_bytes(0, x.data(), o.client_batch, spec.dtype());
          rows += o.client_batch;
        }
      } catch (const std::exception& e) {
        ++failed;
        std::cerr << "client " << c << ": " << e.what() << "\n";
      }
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the sessions find the job
  go = true;
  const double t0 = now_seconds();
  const int64_t at0 = rows;
  std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(o.seconds * 1e3)));
  const double seconds = now_seconds() - t0;
  const int64_t done = rows - at0;
  stop = true;
  for (auto& t : threads) t.join();
  *failures = failed;
  return static_cast<double>(done) / seconds;
}

void throughput(const Options& o, const v1::JobSpec& spec, double in_process_best, Report& r) {
  Report& sec = r.section("throughput");
  sec.add("client_batch", o.client_batch);
  sec.add("in_process_rows_per_s_at_batch_" + std::to_string(o.batches.back()), in_process_best);
  for (int C : o.clients) {
    int64_t failures = 0;
    const double rate = client_rows_per_s(o, spec, C, &failures);
    Report& e = sec.section("clients_" + std::to_string(C));
    e.add("rows_per_s", rate);
    e.add("fraction_of_in_process", in_process_best > 0 ? rate / in_process_best : 0.0);
    e.add("failed_clients", failures);
  }
}

Report run(const Options& o) {
  client::Session s(session_options(o, "bench"));
  const v1::JobSpec& spec = s.spec();
  Report r;
  add_cpu_kernels(r, layer_spec::JobView(spec).dtype);
  r.add("job", o.job);
  r.add("shape", "H=" + std::to_string(spec.hidden()) + " I=" + std::to_string(spec.ffn_hidden()) +
                     " E=" + std::to_string(spec.experts()) + " K=" + std::to_string(spec.top_k()) + " " +
                     v1::JobSpec::DType_Name(spec.dtype()));
  r.add("serve_max_wait_ms", static_cast<int64_t>(spec.serve_max_wait_ms()));
  r.add("in_process_threads", static_cast<int64_t>(o.threads));
  r.add("client_malloc_tuned", o.malloc_tuning);
  kernels::ThreadPool pool(o.threads);
  auto be = kernels::make_cpu_backend(pool);
  v1::JobSpec one = spec;  // the in-process layer: the job's layer 0, built as the daemon builds it
  one.set_mode(v1::JobSpec::forward);
  one.set_serve_train(false);
  ep::MoeLayer layer(layer_spec::layer_config(one), *be);
  layer.set_weights(layer_spec::layer_weights(one, 0, std::vector<bool>(spec.experts(), true)));
  const double best = latency(o, s, layer, r);  // the in-process layer's rows/s at the largest batch
  throughput(o, spec, best, r);
  return r;
}

}  // namespace
}  // namespace moe::bench

int main(int argc, char** argv) {
  using namespace moe;
  CLI::App app{"moe-serve-bench: a serving job's call latency and throughput beside the in-process layer"};
  bench::Options o;
  std::string output = "table";
  app.add_option("--job", o.job, "the serving job's id")->required();
  app.add_option("--agent", o.agent, "HOST:PORT (default: the local cluster's)");
  app.add_option("--state-dir", o.state_dir, "a local cluster's state directory")->envname("MOE_STATE_DIR");
  app.add_option("--token-file", o.token_file, "the cluster token");
  app.add_option("--batches", o.batches, "batch sizes of the latency table (the last also the in-process peak)");
  app.add_option("--clients", o.clients, "client counts of the throughput table");
  app.add_option("--client-batch", o.client_batch, "rows a throughput client's call");
  app.add_option("--calls", o.calls, "calls a batch size and round");
  app.add_option("--rounds", o.rounds, "rounds of in-process and served calls, interleaved");
  app.add_option("--seconds", o.seconds, "seconds a client count");
  app.add_option("--threads", o.threads, "the in-process layer's threads (the daemon's --threads)");
  app.add_option("--wire-min-bytes", o.wire_min_bytes,
                 "calls with this many bytes of rows use the tensor wire (0: all; docs/serving.md#data-path)");
  app.add_flag("--compare-paths", o.compare_paths, "latency also with every call framed and every call on the wire");
  app.add_option("--output", output, "table or json")->check(CLI::IsMember({"table", "json"}));
  bool no_tuning = false;
  app.add_flag("--no-malloc-tuning", no_tuning, "leave glibc's malloc as it is (it maps and trims large buffers)");
  CLI11_PARSE(app, argc, argv);
  o.malloc_tuning = !no_tuning;
  if (o.malloc_tuning) {  // what moed does, and what docs/serving.md suggests for a client process
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 128 << 20);
  }
  try {
    const bench::Report r = bench::run(o);
    if (output == "json") r.print_json(std::cout);
    else r.print_table(std::cout);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "moe-serve-bench: " << e.what() << "\n";
    return 1;
  }
}
