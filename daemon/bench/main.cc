// moe-bench: benchmark programs that print figures (never pass/fail on time).
//   moe-bench layer   [--tokens-per-rank ... --mode forward|train --dtype fp32|bf16 --threads N --dump DIR]
//   moe-bench permute [--hidden ... --threads N]
//   moe-bench ep      [--ranks R --transport ucx|inproc --tokens-per-rank T ...]
// Flags are named as moectl's job flags (--ffn-hidden, --tokens-per-rank); the
// older --ffn and --tokens still work.
#include <CLI/CLI.hpp>

#include <iostream>
#include <thread>

#include "moe/base/version.h"
#include "moe/kernels/cpu_backend.h"
#include "benches.h"
#include "moe/base/check.h"
#include "moe/transport/bootstrap.h"
#include "moe/transport/transport_factory.h"

int main(int argc, char** argv) {
  using namespace moe;
  CLI::App app{"moe-bench: MoE benchmark programs"};
  app.set_version_flag("--version", [] { return moe::version_line("moe-bench") + "\n" + moe::kernels::cpu_backend_summary(); });
  app.require_subcommand(1);
  app.option_defaults()->always_capture_default();  // --help shows every default
  std::string output = "table";
  app.add_option("--output", output, "table or json")->check(CLI::IsMember({"table", "json"}));
  const int default_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  bench::LayerBenchOptions lo;
  lo.threads = default_threads;
  std::string mode = "forward", dtype = "fp32", score = "softmax", drop = "probs", moments = "fp32";
  CLI::App* layer = app.add_subcommand("layer", "one MoE layer on one rank");
  layer->add_option("--tokens-per-rank,--tokens", lo.tokens, "tokens T (moectl's --tokens-per-rank)");
  layer->add_option("--hidden", lo.hidden, "hidden size H");
  layer->add_option("--ffn-hidden,--ffn", lo.ffn, "expert FFN width I");
  layer->add_option("--experts", lo.experts, "experts E");
  layer->add_option("--top-k", lo.top_k, "experts per token K");
  layer->add_option("--mode", mode, "forward or train")->check(CLI::IsMember({"forward", "train"}));
  layer->add_option("--dtype", dtype, "fp32 or bf16")->check(CLI::IsMember({"fp32", "bf16"}));
  layer->add_option("--threads", lo.threads, "threads of the rank's pool");
  layer->add_option("--iters", lo.iters, "timed steps (the median is reported)");
  layer->add_option("--warmup", lo.warmup, "untimed steps first (step 0 included)");
  layer->add_option("--seed", lo.seed, "seed of inputs and weights");
  layer->add_option("--score", score, "softmax or sigmoid")->check(CLI::IsMember({"softmax", "sigmoid"}));
  layer->add_option("--num-groups", lo.num_groups, "expert groups for group-limited routing");
  layer->add_option("--group-top-k", lo.group_top_k, "groups kept per token");
  layer->add_option("--capacity-factor", lo.capacity_factor, "0 = dropless");
  layer->add_option("--drop-policy", drop, "probs or position")->check(CLI::IsMember({"probs", "position"}));
  layer->add_option("--skew", lo.skew, "uniform or zipf:ALPHA");
  layer->add_option("--dump", lo.dump_dir, "write DIR/rank0.safetensors and DIR/spec.json of step 0");
  layer->add_option("--peak-n", lo.peak_n, "size of the square GEMM that defines the peak (the layer's engine and dtype)");
  layer->add_option("--optimizer", lo.optimizer, "train: an optimizer step after each backward (none, adam, sgd)")
      ->check(CLI::IsMember({"none", "adam", "sgd"}));
  layer->add_option("--moments", moments, "adam: how the moments are stored (fp32 or bf16)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  layer->add_option("--output", output, "table or json")->check(CLI::IsMember({"table", "json"}));

  bench::PermuteBenchOptions po;
  po.threads = default_threads;
  CLI::App* permute = app.add_subcommand("permute", "permute/unpermute bandwidth beside memcpy");
  permute->add_option("--hidden", po.hidden, "row width in fp32 values");
  permute->add_option("--top-k", po.top_k, "rows per token");
  permute->add_option("--experts", po.experts, "experts");
  permute->add_option("--threads", po.threads, "threads");
  permute->add_option("--iters", po.iters, "timed runs (the best is reported)");
  permute->add_option("--bytes", po.bytes, "permuted buffer bytes (default max(4 x L3, 256 MiB))");
  permute->add_option("--output", output, "table or json")->check(CLI::IsMember({"table", "json"}));

  bench::EpBenchOptions eo;
  eo.threads = 1;
  std::string ep_dtype = "fp32";
  int ep_rank = -1, ep_port = 0;
  auto add_ep_flags = [&](CLI::App* c) {
    c->add_option("--ranks", eo.ranks, "EP ranks");
    c->add_option("--tokens-per-rank,--tokens", eo.tokens, "tokens per rank");
    c->add_option("--hidden", eo.hidden, "hidden size H");
    c->add_option("--ffn-hidden,--ffn", eo.ffn, "expert FFN width I");
    c->add_option("--experts", eo.experts, "experts E (divisible by ranks)");
    c->add_option("--top-k", eo.top_k, "experts per token K");
    c->add_option("--threads", eo.threads, "threads per rank");
    c->add_option("--iters", eo.iters, "timed steps per mode (medians are reported)");
    c->add_option("--warmup", eo.warmup, "untimed forward steps first");
    c->add_option("--dtype", ep_dtype, "fp32 or bf16")->check(CLI::IsMember({"fp32", "bf16"}));
    c->add_option("--seed", eo.seed, "seed of inputs and weights");
  };
  CLI::App* ep = app.add_subcommand("ep", "the expert-parallel layer across ranks");
  add_ep_flags(ep);
  ep->add_option("--transport", eo.transport, "ucx (processes) or inproc (threads)")
      ->check(CLI::IsMember({"ucx", "inproc"}));
  ep->add_flag("!--no-perftest", eo.perftest, "skip the ucx_perftest baseline");
  ep->add_option("--output", output, "table or json")->check(CLI::IsMember({"table", "json"}));
  CLI::App* ep_rank_cmd = app.add_subcommand("ep-rank", "one UCX rank of `ep` (started by it)");
  ep_rank_cmd->group("");  // internal: not listed in --help
  add_ep_flags(ep_rank_cmd);
  ep_rank_cmd->add_option("--rank", ep_rank)->required();
  ep_rank_cmd->add_option("--port", ep_port)->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    bench::Report r;
    eo.dtype = kernels::parse_dtype(ep_dtype);
    if (*ep_rank_cmd) {
      // One process per rank: the transport factory gives it UCX.
      transport::TcpBootstrap boot("127.0.0.1", ep_port, ep_rank, eo.ranks);
      const transport::RankTransports t =
          transport::make_rank_transports({.rank = ep_rank, .world = eo.ranks, .bootstrap = &boot});
      std::cout << bench::run_ep_rank(eo, *t.host).encode() << std::endl;
      t.host->barrier(transport::deadline_in(std::chrono::seconds(60)));
      return 0;
    }
    if (*ep) {
      r = bench::run_ep_bench(eo, "/proc/self/exe");
    } else if (*layer) {
      lo.train = mode == "train";
      lo.dtype = kernels::parse_dtype(dtype);
      lo.moments = kernels::parse_dtype(moments);
      lo.score = kernels::parse_score(score);
      lo.drop_policy = kernels::parse_drop_policy(drop);
      r = bench::run_layer_bench(lo);
    } else {
      r = bench::run_permute_bench(po);
    }
    if (output == "json") r.print_json(std::cout);
    else r.print_table(std::cout);
  } catch (const Error& e) {
    std::cerr << "moe-bench: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
