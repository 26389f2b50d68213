// The GPU benchmarks of the device check (docs/device-check.md#moe-gpu-check), each printing one JSON
// object (moe-bench style) with a same-run peer to compare with:
//   layer:   the single-rank layer, forward and train, bf16 (tokens/s and phases);
//   permute: permute and unpermute GB/s beside a device-to-device copy;
//   gemm:    the bf16 expert GEMMs beside one dense cuBLAS bf16 GEMM of the same
//            FLOPs, and fp32 groups as a stream loop against cublasGemmGroupedBatchedEx.
// The eager PyTorch peer of the layer is daemon/bench/torch_layer.py --device cuda
// (device_check.sh runs it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe::gpucheck {

struct BenchShape {
  int64_t tokens = 16384;
  int hidden = 4096, ffn_hidden = 1536, experts = 64, top_k = 8;
  int iters = 10, warmup = 3;
};

// Runs every benchmark on CUDA device 0; returns one JSON line per figure.
std::vector<std::string> run_benches(const BenchShape& shape);

}  // namespace moe::gpucheck
