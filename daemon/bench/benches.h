// The benchmark programs behind `moe-bench`. Each returns a Report of figures;
// none asserts on time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe/kernels/types.h"
#include "report.h"
#include "moe/transport/communicator.h"

namespace moe::bench {

// Which code produced a CPU figure: the kernels' ISA and every kernel family's
// kernel or engine (the layer dtype's GEMM engine), added to `r`.
void add_cpu_kernels(Report& r, kernels::DType dtype);

// `moe-bench layer`: one MoE layer on one rank (CPU backend).
struct LayerBenchOptions {
  int64_t tokens = 4096;
  int hidden = 1024;
  int ffn = 512;
  int experts = 64;
  int top_k = 8;
  bool train = false;
  kernels::DType dtype = kernels::DType::kF32;
  int threads = 1;
  int iters = 5;
  int warmup = 1;
  uint64_t seed = 0;
  kernels::ScoreFunc score = kernels::ScoreFunc::kSoftmax;
  int num_groups = 0;
  int group_top_k = 0;
  double capacity_factor = 0.0;
  kernels::DropPolicy drop_policy = kernels::DropPolicy::kProbs;
  std::string skew = "uniform";
  std::string dump_dir;  // writes rank0.safetensors and spec.json of step 0
  int peak_n = 4096;     // size of the GEMM (the layer's engine and dtype) that defines the peak
  std::string optimizer = "none";  // train: none, adam or sgd, a step after each backward (timed apart)
  kernels::DType moments = kernels::DType::kF32;  // adam: how the moments are stored
};
Report run_layer_bench(const LayerBenchOptions& o);

// `moe-bench permute`: permute / unpermute bandwidth beside memcpy on a buffer of
// at least 4x the L3 cache.
struct PermuteBenchOptions {
  int hidden = 1024;
  int top_k = 8;
  int experts = 64;
  int threads = 1;
  int iters = 5;
  int64_t bytes = 0;  // permuted buffer size; 0 = max(4 x L3, 256 MiB)
};
Report run_permute_bench(const PermuteBenchOptions& o);

// `moe-bench ep`: the EP layer over R ranks (threads + in-process transport, or
// processes + UCX on loopback), forward and train, with transport accounting and,
// for UCX, a same-run ucx_perftest baseline.
struct EpBenchOptions {
  int ranks = 2;
  std::string transport = "ucx";
  int64_t tokens = 2048;  // per rank
  int hidden = 1024;
  int ffn = 512;
  int experts = 64;
  int top_k = 8;
  int threads = 1;  // per rank
  int iters = 5;
  int warmup = 1;
  kernels::DType dtype = kernels::DType::kF32;
  uint64_t seed = 0;
  bool perftest = true;
  std::vector<std::string> rank_args() const;  // flags that rebuild these options in a rank process
};

// One rank's medians and accounting; travels from a rank process as one text line.
struct EpRankStats {
  double forward_seconds = 0, train_seconds = 0, dispatch_seconds = 0, combine_seconds = 0;
  int64_t dispatch_bytes = 0, combine_bytes = 0, naive_dispatch_bytes = 0;
  std::string encode() const;
  static EpRankStats decode(const std::string& text);
};

EpRankStats run_ep_rank(const EpBenchOptions& o, transport::Communicator& comm);
// self_exe: this program, re-run as `ep-rank` for each UCX rank.
Report run_ep_bench(const EpBenchOptions& o, const std::string& self_exe);

}  // namespace moe::bench
