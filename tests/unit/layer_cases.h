// The single-rank layer's cases and their check against the fp64 reference,
// framework-free so every backend runs the same ones: layer_test (the CPU backend
// and each of its GEMM engines) and the CUDA checks (gpu_test, moe-gpu-check).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe/kernels/api.h"

namespace moe::test {

enum class Special { kNone, kTies, kZeroTokenExperts, kAllOnOne };
// The CPU GEMM engine a case asks for: the table's, oneDNN explicitly, or OpenBLAS
// through the MOE_GEMM_ENGINE override. Other backends run only kTable cases.
enum class Engine { kTable, kOneDnn, kOpenBlasOverride };

struct LayerCase {
  const char* name;
  int64_t T;
  int H, I, E, K;
  kernels::ScoreFunc score = kernels::ScoreFunc::kSoftmax;
  int groups = 0, group_top_k = 0;
  bool norm = true;
  float scaling = 1.0f;
  double cf = 0.0;
  kernels::DropPolicy policy = kernels::DropPolicy::kProbs;
  kernels::DType dtype = kernels::DType::kF32;
  Special special = Special::kNone;
  bool selection_bias = false;
  Engine engine = Engine::kTable;
};

std::vector<LayerCase> layer_cases();

// Runs the case forward and backward on a train MoeLayer over `be` (inputs and
// outputs in the backend's memory) and compares everything with the fp64
// reference. Returns "" when it all agrees, else one line per failure.
std::string check_layer(kernels::Backend& be, const LayerCase& c);

}  // namespace moe::test
