// The op checks of gpu_checks.h on the CPU backend, the specification: this checks
// the checks themselves on any machine, nvcc or not (gpu_test runs them on CUDA).
#include <gtest/gtest.h>


#include "gpu_checks.h"
#include "moe/kernels/cpu_backend.h"

namespace moe::gpucheck {

namespace {

std::string test_name(const ::testing::TestParamInfo<Check>& info) { return case_name(info.param); }

class OpCheck : public ::testing::TestWithParam<Check> {};

TEST_P(OpCheck, CpuBackend) {
  kernels::ThreadPool pool(2);
  auto be = kernels::make_cpu_backend(pool);
  const Result r = GetParam().run(*be);
  EXPECT_TRUE(r.passed) << GetParam().name << ": " << r.detail;
}

INSTANTIATE_TEST_SUITE_P(Ops, OpCheck, ::testing::ValuesIn(op_checks()), test_name);

}  // namespace
}  // namespace moe::gpucheck
