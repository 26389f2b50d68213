// The single-rank MoE layer (router, capacity, permute, fused experts, combine,
// and the backward through all of it) against the fp64 reference, on the CPU
// backend with each GEMM engine (the cases and the check: layer_cases.cc).
#include <gtest/gtest.h>

#include <cmath>
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

// A bf16 train layer keeps fp32 masters that an optimizer step moves off the bf16
// grid; every engine must compute with them rounded (kernels/api.h). After one
// Adam step the layer's outputs are bitwise those of a layer given the rounded
// weights it reports, and the second layer's forward would differ if a kernel
// read the unrounded masters.
class Bf16Masters : public ::testing::TestWithParam<kernels::GemmEngine> {};

TEST_P(Bf16Masters, ATrainedBf16LayerComputesWithItsMastersRounded) {
  if (!kernels::onednn_supports(DType::kBF16) && GetParam() == kernels::GemmEngine::kOneDnn)
    GTEST_SKIP() << "oneDNN has no bf16 matmul on this CPU";
  kernels::ThreadPool pool(2);
  kernels::CpuEngines engines = kernels::cpu_backend_info().engines;
  engines.bf16 = GetParam();
  auto be = kernels::make_cpu_backend(pool, engines);
  const ep::LayerSpec spec{.experts = 4, .top_k = 2, .hidden = 64, .ffn_hidden = 32, .dtype = DType::kBF16,
                           .tokens_per_rank = 256, .train = true};
  const int64_t T = spec.tokens_per_rank, H = spec.hidden;
  ep::MoeLayer trained(ep::layer_config(spec), *be), fresh(ep::layer_config(spec), *be);
  const model::LayerWeights w0 = model::make_layer_weights(3, 0, {64, 32, 4});
  trained.set_weights(w0);
  auto inputs = [&](uint64_t seed) {
    std::vector<float> v(T * H);
    model::fill_inputs(seed, 0, 0, T, static_cast<int>(H), v.data());
    return model::to_storage(v, DType::kBF16);
  };
  std::vector<uint8_t> out(T * H * 2), grad_x(T * H * 2), again(T * H * 2);
  const std::vector<uint8_t> x0 = inputs(1);  // read again by the backward
  trained.forward(x0.data(), T, out.data());
  trained.backward(inputs(2).data(), grad_x.data());
  kernels::OptimizerConfig adam;
  adam.lr = 3e-3f;  // moves most masters by ~lr, far off their bf16 neighbours
  trained.optimizer_step(adam, 1);

  const model::LayerWeights used = trained.weights();
  size_t moved = 0;
  for (size_t i = 0; i < used.w13.size(); ++i) {
    ASSERT_EQ(used.w13[i], kernels::round_to_bf16(used.w13[i])) << "weights() is not the rounded copy at " << i;
    moved += used.w13[i] != kernels::round_to_bf16(w0.w13[i]);
  }
  ASSERT_GT(moved, used.w13.size() / 2) << "the step moved too few weights to tell";
  fresh.set_weights(used);
  const std::vector<uint8_t> x = inputs(4);
  trained.forward(x.data(), T, out.data());
  fresh.forward(x.data(), T, again.data());
  EXPECT_EQ(out, again) << "the trained layer computed with other weights than the rounded masters";
}

INSTANTIATE_TEST_SUITE_P(Engines, Bf16Masters,
                         ::testing::Values(kernels::GemmEngine::kOpenBlas, kernels::GemmEngine::kOneDnn),
                         [](const ::testing::TestParamInfo<kernels::GemmEngine>& info) {
                           return std::string(kernels::gemm_engine_name(info.param));
                         });

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
