// The benchmark programs behind `moe-bench`. Each returns a Report of figures;
// none asserts on time.
#pragma once

#include <cstdint>
#include <string>

#include "moe/kernels/types.h"
#include "report.h"

namespace moe::bench {

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
  int peak_n = 4096;     // size of the sgemm that defines the peak
};
Report run_layer_bench(const LayerBenchOptions& o);

// `moe-bench permute`: permute / unpermute bandwidth beside memcpy on a buffer of
// at least 4x the L3 cache.
struct PermuteBenchOptions {
  int hidden = 1024;
  int top_k = 8;
  int experts = 64;
  int threads = 1;
  int iters = 3;
  int64_t bytes = 0;  // permuted buffer size; 0 = max(4 x L3, 256 MiB)
};
Report run_permute_bench(const PermuteBenchOptions& o);

}  // namespace moe::bench
