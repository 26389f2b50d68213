// moe-bench as a process: its JSON carries the promised fields, and its --dump is
// a self-contained check: the fp64 reference recomputed from the dumped x and
// weights matches the dumped out, topk and gradients.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <sstream>

#include "moe/io/layer_io.h"
#include "moe/io/safetensors.h"
#include "moe/ep/reference.h"
#include "process.h"
#include "test_util.h"

#ifndef MOE_BENCH_BIN
#error "MOE_BENCH_BIN must name the moe-bench executable"
#endif

namespace moe::test {
namespace {

namespace fs = std::filesystem;

// moe-bench with the space-separated args: its exit code; *out gets what it wrote.
int run_bench(const std::string& args, std::string* out) {
  std::vector<std::string> argv{MOE_BENCH_BIN};
  std::istringstream in(args);
  for (std::string a; in >> a;) argv.push_back(a);
  Process p = Process::spawn(argv);
  const int code = p.wait(std::chrono::seconds(120));
  *out = p.output();
  return code;
}

TEST(BenchDump, TrainDumpMatchesReference) {
  const fs::path dir = fs::temp_directory_path() / ("moe_dump_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::string out;
  const int status = run_bench("layer --tokens 96 --hidden 32 --ffn 16 --experts 8 --top-k 2"
                               " --mode train --threads 2 --iters 1 --peak-n 128 --score sigmoid"
                               " --skew zipf:1.0 --output json --dump " + dir.string(),
                               &out);
  ASSERT_EQ(status, 0) << out;
  for (const char* field : {"\"tokens_per_second\"", "\"gflops\"", "\"gemm_peak_gflops\"",
                            "\"fraction_of_gemm_peak\"", "\"router\"", "\"permute\"", "\"expert_gemm\"",
                            "\"swiglu\"", "\"combine\"", "\"backward\""})
    EXPECT_NE(out.find(field), std::string::npos) << field << " missing in " << out;

  const std::string spec = read_text_file((dir / "spec.json").string());
  EXPECT_NE(spec.find("\"ffn_hidden\": 16"), std::string::npos) << spec;
  EXPECT_NE(spec.find("\"score\": \"sigmoid\""), std::string::npos) << spec;
  EXPECT_NE(spec.find("\"capacity_factor\": 0"), std::string::npos) << "primitives are always printed";

  io::SafetensorsReader r((dir / "rank0.safetensors").string());
  const int64_t T = 96, H = 32, I = 16, E = 8, K = 2;
  const model::LayerShape shape{32, 16, 8};
  io::HfCheckpoint dump((dir / "rank0.safetensors").string());
  model::LayerWeights w = io::load_layer_weights(dump, "", shape);
  w.logit_bias = r.read_f32("gate.logit_bias", {E});
  ref::Config rc;
  rc.hidden = H;
  rc.ffn_hidden = I;
  rc.num_experts = E;
  rc.top_k = K;
  rc.score = ScoreFunc::kSigmoid;
  const std::vector<double> x = to_double(r.read_f32("x", {T, H}));
  const std::vector<int32_t> idx = r.read_i32("topk_idx", {T, K});
  const ref::Weights rw = ep::reference_weights(w);
  const ref::Forward f = ref::forward(rc, rw, x, T, ref::forced(idx.data()));
  const ref::Forward own = ref::forward(rc, rw, x, T);
  for (int64_t t = 0; t < T; ++t) {
    if (own.selection_margin[t] <= 1e-5) continue;  // a near-tie fp32 cannot break like fp64
    for (int k = 0; k < K; ++k) EXPECT_EQ(idx[t * K + k], own.topk_idx[t * K + k]);
  }
  EXPECT_TRUE(close("out", to_double(r.read_f32("out", {T, H})), f.out, 1e-4, 1e-5));
  EXPECT_TRUE(close("topk_weight", to_double(r.read_f32("topk_weight", {T, K})), f.topk_weight, 1e-5, 1e-6));
  const ref::Grads g = ref::backward(rc, rw, x, f, to_double(r.read_f32("grad_out", {T, H})));
  EXPECT_TRUE(close("grad_x", to_double(r.read_f32("grad_x", {T, H})), g.grad_x, 1e-4, 1e-5));
  EXPECT_TRUE(close("grad.gate.weight", to_double(r.read_f32("grad.gate.weight", {E, H})), g.grad_gate, 1e-4, 1e-5));
  for (int e = 0; e < E; ++e) {
    const std::string p = "grad.experts." + std::to_string(e) + ".";
    const auto down = r.read_f32(p + "down_proj.weight", {H, I});
    EXPECT_TRUE(close(p + "down_proj", to_double(down),
                      std::vector<double>(g.grad_w2.begin() + e * H * I, g.grad_w2.begin() + (e + 1) * H * I),
                      1e-4, 1e-5, true));
    const auto up = r.read_f32(p + "up_proj.weight", {I, H});
    EXPECT_TRUE(close(p + "up_proj", to_double(up),
                      std::vector<double>(g.grad_w13.begin() + (e * 2 * I + I) * H,
                                          g.grad_w13.begin() + (e + 1) * 2 * I * H),
                      1e-4, 1e-5, true));
  }
  fs::remove_all(dir);
}

TEST(BenchEp, BothTransportsReportTheirFigures) {
  for (const char* transport : {"inproc", "ucx"}) {
    std::string out;
    const int status = run_bench(std::string("ep --transport ") + transport +
                                     " --ranks 3 --tokens 64 --hidden 64 --ffn 32 --experts 12 --top-k 4"
                                     " --iters 2 --no-perftest --output json",
                                 &out);
    ASSERT_EQ(status, 0) << out;
    for (const char* field : {"\"forward_tokens_per_second\"", "\"train_tokens_per_second\"", "\"dispatch_gbps\"",
                              "\"combine_gbps\"", "\"dispatch_over_naive\"", "\"naive_dispatch_bytes\""})
      EXPECT_NE(out.find(field), std::string::npos) << transport << ": " << field << " missing in " << out;
  }
}

TEST(BenchDump, BadFlagsExitWithUsageCode) {
  std::string out;
  EXPECT_EQ(run_bench("layer --mode sideways", &out), 2);
  EXPECT_EQ(run_bench("layer --tokens 8 --experts 4 --top-k 9 --peak-n 64", &out), 2);
  EXPECT_EQ(run_bench("ep --ranks 3 --experts 8 --transport inproc", &out), 2);
  EXPECT_NE(out.find("divisible"), std::string::npos) << out;
}

}  // namespace
}  // namespace moe::test
