// The single-rank MoE layer (router, capacity, permute, fused experts, combine,
// and the backward through all of it) against the fp64 reference, on the CPU
// backend with each GEMM engine (the cases and the check: layer_cases.cc).
#include <gtest/gtest.h>

#include <cstdlib>

#include "layer_cases.h"
#include "moe/base/check.h"
#include "moe/ep/moe_layer.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/model/synthetic.h"

namespace moe::test {

// gtest prints a case by its name (found by argument-dependent lookup).
void PrintTo(const LayerCase& c, std::ostream* os) { *os << c.name; }

namespace {

using kernels::DType;

// The backend for a case, or null with the reason in *skip when this CPU cannot
// run the engine the case asks for.
std::unique_ptr<kernels::Backend> make_backend(kernels::ThreadPool& pool, const LayerCase& c, std::string* skip) {
  const std::string dtype = kernels::dtype_name(c.dtype);
  switch (c.engine) {
    case Engine::kTable:
      return kernels::make_cpu_backend(pool);
    case Engine::kOneDnn: {
      if (!kernels::onednn_supports(c.dtype)) {
        *skip = "oneDNN has no " + dtype + " matmul on this CPU (ISA " + kernels::cpu_backend_info().isa + ")";
        return nullptr;
      }
      kernels::CpuEngines e = kernels::cpu_backend_info().engines;
      (c.dtype == DType::kF32 ? e.fp32 : e.bf16) = kernels::GemmEngine::kOneDnn;
      return kernels::make_cpu_backend(pool, e);
    }
    case Engine::kOpenBlasOverride: {
      ::setenv("MOE_GEMM_ENGINE", (dtype + "=openblas").c_str(), 1);
      auto be = kernels::make_cpu_backend(pool);
      ::unsetenv("MOE_GEMM_ENGINE");
      return be;
    }
  }
  return nullptr;
}

class LayerVsReference : public ::testing::TestWithParam<LayerCase> {};

TEST_P(LayerVsReference, ForwardAndBackward) {
  const LayerCase& c = GetParam();
  kernels::ThreadPool pool(2);
  std::string skip;
  auto be = make_backend(pool, c, &skip);
  if (!be) GTEST_SKIP() << skip;
  if (c.engine == Engine::kOneDnn) {
    ASSERT_EQ(be->gemm_engine(c.dtype), "onednn");
  } else if (c.engine == Engine::kOpenBlasOverride) {
    ASSERT_EQ(be->gemm_engine(c.dtype), "openblas");
  }
  EXPECT_EQ(check_layer(*be, c), "");
}

INSTANTIATE_TEST_SUITE_P(Cases, LayerVsReference, ::testing::ValuesIn(layer_cases()),
                         [](const ::testing::TestParamInfo<LayerCase>& info) { return std::string(info.param.name); });

TEST(MoeLayer, RejectsBadUse) {
  kernels::ThreadPool pool(1);
  auto be = kernels::make_cpu_backend(pool);
  ep::LayerSpec spec{.experts = 4, .top_k = 5, .hidden = 8, .ffn_hidden = 4, .tokens_per_rank = 4};
  EXPECT_THROW(ep::MoeLayer(ep::layer_config(spec), *be), Error);  // top_k > experts
  spec.top_k = 2;
  ep::MoeLayer layer(ep::layer_config(spec), *be);
  std::vector<float> x(8 * 8), out(8 * 8);
  EXPECT_THROW(layer.forward(x.data(), 2, out.data()), Error);  // no weights yet
  model::LayerWeights w = model::make_layer_weights(1, 0, {8, 4, 4});
  w.w2.pop_back();
  EXPECT_THROW(layer.set_weights(w), Error);  // wrong size names the tensor
  layer.set_weights(model::make_layer_weights(1, 0, {8, 4, 4}));
  EXPECT_THROW(layer.forward(x.data(), 5, out.data()), Error);  // T > max_tokens
  EXPECT_THROW(layer.backward(x.data(), out.data()), Error);    // not a train layer
}

}  // namespace
}  // namespace moe::test
