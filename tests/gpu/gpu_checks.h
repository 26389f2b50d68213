// The CUDA backend's checks: every op and the single-rank layer against plain host
// references (fp64 where there is arithmetic, exact where there are indices) and
// the fp64 reference of kernels/ref. Plain C++ with no test framework, so the
// device machine's `moe-gpu-check` (docs/device-check.md) and the GoogleTest `gpu_test` run
// the same checks.
#pragma once

#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "moe/kernels/api.h"

namespace moe::gpucheck {

struct Result {
  bool passed = true;
  std::string detail;  // the worst error seen, or what failed
};

// A check runs on the backend it is given (a CUDA backend; the op checks also run
// on the CPU backend in op_check_test, as a cross-check of the checks themselves).
struct Check {
  std::string name;
  std::function<Result(kernels::Backend&)> run;
};

// One check per op of the kernel API (several for some: dtypes, edge cases).
const std::vector<Check>& op_checks();
// The single-rank layer's cases (layer_cases.h) of the table's engine.
const std::vector<Check>& layer_checks();
// The checks whose result depends on how grouped GEMMs run (run again with
// MOE_CUDA_GEMM=grouped): the grouped GEMM op and the layer.
const std::vector<Check>& gemm_checks();
// op_checks, then layer_checks.
const std::vector<Check>& all_checks();

// A check's name as a GoogleTest case name (every other character -> '_'), and
// how GoogleTest prints a check (found by argument-dependent lookup).
std::string case_name(const Check& c);
void PrintTo(const Check& c, std::ostream* os);

}  // namespace moe::gpucheck
