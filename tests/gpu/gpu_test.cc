// The CUDA checks (gpu_checks.h) as GoogleTest cases; they skip where no device is
// visible. op_check_test runs the op checks on the CPU backend, nvcc or not.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>

#include "gpu_checks.h"
#include "moe/base/check.h"
#include "moe/kernels/cuda_device.h"

namespace moe::gpucheck {

namespace {

std::string test_name(const ::testing::TestParamInfo<Check>& info) { return case_name(info.param); }

void expect_passes(const Check& c, kernels::Backend& be) {
  const Result r = c.run(be);
  EXPECT_TRUE(r.passed) << c.name << ": " << r.detail;
}

// The CUDA backend on device 0 with MOE_CUDA_GEMM = gemm, or null (and a skip
// reason) without a device.
std::unique_ptr<kernels::Backend> cuda_backend(const char* gemm) {
  if (kernels::cuda_device_count() == 0) return nullptr;
  ::setenv("MOE_CUDA_GEMM", gemm, 1);
  auto be = kernels::make_cuda_backend(0);
  ::unsetenv("MOE_CUDA_GEMM");
  return be;
}

class OpCheck : public ::testing::TestWithParam<Check> {};

TEST_P(OpCheck, CudaBackend) {
  auto be = cuda_backend("loop");
  if (!be) GTEST_SKIP() << "no CUDA device";
  expect_passes(GetParam(), *be);
}

INSTANTIATE_TEST_SUITE_P(Ops, OpCheck, ::testing::ValuesIn(op_checks()), test_name);

// The layer on CUDA (layer_test runs the same cases on the CPU backend).
class LayerCheck : public ::testing::TestWithParam<Check> {};

TEST_P(LayerCheck, CudaBackend) {
  auto be = cuda_backend("loop");
  if (!be) GTEST_SKIP() << "no CUDA device";
  expect_passes(GetParam(), *be);
}

INSTANTIATE_TEST_SUITE_P(Layer, LayerCheck, ::testing::ValuesIn(layer_checks()), test_name);

class GroupedGemmCheck : public ::testing::TestWithParam<Check> {};

TEST_P(GroupedGemmCheck, CudaGroupedApi) {
  auto be = cuda_backend("grouped");
  if (!be) GTEST_SKIP() << "no CUDA device";
  EXPECT_EQ(be->gemm_engine(kernels::DType::kF32), "cublas-grouped");
  EXPECT_EQ(be->gemm_engine(kernels::DType::kBF16), "cublas");  // no grouped bf16 -> fp32 kernel
  expect_passes(GetParam(), *be);
}

INSTANTIATE_TEST_SUITE_P(Gemm, GroupedGemmCheck, ::testing::ValuesIn(gemm_checks()), test_name);

TEST(CudaBackend, RefusesAMissingDevice) {
  const int n = kernels::cuda_device_count();
  try {
    kernels::make_cuda_backend(n);  // one past the last device
    FAIL() << "make_cuda_backend(" << n << ") should throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA device " + std::to_string(n)), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moe::gpucheck
