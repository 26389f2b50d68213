// Jobs on Hugging Face checkpoints through a real cluster (docs/formats.md#weights):
// --verify jobs, forward and train, on a Mixtral-named BF16 file (model fields by flags)
// and on a DeepSeek-named F32 checkpoint sharded over three files (correction
// bias, sigmoid, groups; model fields, prefix and first layer by --hf-config)
// and a Qwen2-MoE BF16 checkpoint over two files with a gated shared expert (its
// tensors loaded: the dumps hold them)
// pass on 1x1 and 2x2, compute with the file's weights (the dumps hold them, and
// the fp64 reference on the written weights gives the dumped outputs) and give
// the same outputs on both shapes; a bad checkpoint fails the job before
// step 0 naming the tensor.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "hf_files.h"
#include "local_cluster.h"
#include "moe/ep/reference.h"
#include "moe/io/safetensors.h"
#include "test_util.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

constexpr int kE = 8, kH = 32, kI = 16, kLayers = 2;

// A checkpoint of checkpoint layers [first, first + kLayers) and the job that reads it.
struct Case {
  std::string name;
  HfScheme scheme;
  ref::Config routing;  // what spec_flags or hf_config say, for the reference
  io::StDType dtype;
  int shards;
  std::string prefix;  // with {layer}
  int first_layer;
  std::vector<std::string> spec_flags;
  // A config.json for --hf-config: when set, the job gets the model fields, the
  // prefix and the first layer from it, and spec_flags are not given.
  std::string hf_config = {};
  int shared_width = 0;  // shared_experts x shared_ffn_hidden
  std::vector<model::LayerWeights> layers = {};  // as written, by job layer
  fs::path dir = {};

  std::string prefix_of(int job_layer) const {
    std::string p = prefix;
    return p.replace(p.find("{layer}"), 7, std::to_string(first_layer + job_layer));
  }
  model::LayerShape shape() const { return {kH, kI, kE, shared_width, scheme.shared_gate}; }
  void write(const fs::path& root) {
    dir = root / name;
    std::vector<NamedTensor> all;
    for (int l = 0; l < kLayers; ++l) {
      layers.push_back(as_stored(hf_layer_values(40 + l, shape(), scheme.correction_bias), dtype));
      for (auto& t : hf_layer_tensors(prefix_of(l), shape(), layers.back(), scheme)) all.push_back(t);
    }
    write_hf_checkpoint(dir.string(), split(all, shards), dtype);
    if (!hf_config.empty()) std::ofstream(dir / "config.json") << hf_config;
  }
  std::vector<std::string> flags() const {
    if (!hf_config.empty())
      return {"--hf-config", (dir / "config.json").string(), "--weights", dir.string(), "--layers",
              std::to_string(kLayers), "--seed", "5", "--verify"};
    std::vector<std::string> f = {"--experts", std::to_string(kE), "--hidden", std::to_string(kH), "--ffn-hidden",
                                  std::to_string(kI), "--layers", std::to_string(kLayers), "--weights", dir.string(),
                                  "--weights-prefix", prefix, "--weights-first-layer", std::to_string(first_layer),
                                  "--seed", "5", "--verify"};
    f.insert(f.end(), spec_flags.begin(), spec_flags.end());
    return f;
  }
};

ref::Config routing(int top_k, ScoreFunc score, int groups, int group_top_k, float scaling) {
  ref::Config c;
  c.hidden = kH;
  c.ffn_hidden = kI;
  c.num_experts = kE;
  c.top_k = top_k;
  c.score = score;
  c.num_groups = groups;
  c.group_top_k = group_top_k;
  c.routed_scaling_factor = scaling;
  return c;
}

std::vector<Case> cases() {
  HfScheme mixtral;
  mixtral.experts = io::ExpertNaming::kMixtral;
  HfScheme deepseek;
  deepseek.correction_bias = true;
  HfScheme qwen2;
  qwen2.shared = io::SharedNaming::kQwen;
  qwen2.shared_gate = true;
  ref::Config qwen2_routing = routing(2, ScoreFunc::kSoftmax, 0, 0, 1.0f);
  qwen2_routing.norm_topk_prob = false;
  return {
      {"mixtral_bf16",
       mixtral,
       routing(2, ScoreFunc::kSoftmax, 0, 0, 1.0f),
       io::StDType::kBF16,
       1,
       "model.layers.{layer}.block_sparse_moe.",
       1,
       {"--top-k", "2"}},
      {"deepseek_sharded",
       deepseek,
       routing(3, ScoreFunc::kSigmoid, 4, 2, 2.5f),
       io::StDType::kF32,
       3,
       "model.layers.{layer}.mlp.",
       3,
       {},
       R"({"model_type": "deepseek_v3", "hidden_size": 32, "moe_intermediate_size": 16, "n_routed_experts": 8,
           "n_shared_experts": 0, "num_experts_per_tok": 3, "first_k_dense_replace": 3, "norm_topk_prob": true,
           "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 4, "topk_group": 2,
           "routed_scaling_factor": 2.5})"},
      {"qwen2_shared_bf16",
       qwen2,
       qwen2_routing,
       io::StDType::kBF16,
       2,
       "model.layers.{layer}.mlp.",
       0,
       {},
       R"({"model_type": "qwen2_moe", "hidden_size": 32, "moe_intermediate_size": 16, "num_experts": 8,
           "num_experts_per_tok": 2, "shared_expert_intermediate_size": 24, "norm_topk_prob": false})",
       24},
  };
}

// Runs one job; returns its result (failing the test unless it passed verify).
v1::JobResult run_job(const Cluster& c, std::vector<std::string> args) {
  args.insert(args.begin(), {"--output", "json", "job", "submit", "--wait"});
  const auto [rc, out] = c.ctl(args, 180s);
  EXPECT_EQ(rc, 0) << out << c.logs();
  const v1::JobResult r = parse_result(out);
  EXPECT_EQ(r.state(), v1::JOB_STATE_SUCCEEDED) << out;
  EXPECT_TRUE(r.verify().passed()) << out;
  return r;
}

// The shared experts of layer 0 in a rank's dump (named either way) are the
// checkpoint's.
void expect_dumped_shared(const io::SafetensorsReader& f, const Case& k) {
  const model::LayerWeights& w = k.layers[0];
  const int64_t Is = k.shared_width;
  const std::string p = f.has("shared_expert.up_proj.weight") ? "shared_expert." : "shared_experts.";
  const auto* up = w.shared_w13.data() + Is * kH;
  EXPECT_EQ(f.read_f32(p + "up_proj.weight", {Is, kH}), std::vector<float>(up, up + Is * kH)) << k.name;
  EXPECT_EQ(f.read_f32(p + "down_proj.weight", {kH, Is}), w.shared_w2) << k.name;
  if (k.scheme.shared_gate) {
    EXPECT_EQ(f.read_f32("shared_expert_gate.weight", {1, kH}), w.shared_gate) << k.name;
  }
}

// Layer 0's weights in every rank's dump are the checkpoint's (the experts each
// rank hosts, the router and the bias); returns how many experts were seen.
int expect_dumped_weights(const fs::path& dumps, int ranks, const Case& k) {
  const model::LayerWeights& w = k.layers[0];
  int experts = 0;
  for (int r = 0; r < ranks; ++r) {
    io::SafetensorsReader f((dumps / ("rank" + std::to_string(r) + ".safetensors")).string());
    EXPECT_EQ(f.read_f32("gate.weight", {kE, kH}), w.gate) << k.name << " rank " << r;
    if (k.scheme.correction_bias) {
      EXPECT_EQ(f.read_f32("gate.e_score_correction_bias", {kE}), w.selection_bias);
    }
    if (k.shared_width > 0) expect_dumped_shared(f, k);
    for (int e = 0; e < kE; ++e) {
      const std::string p = "experts." + std::to_string(e) + ".";
      if (!f.has(p + "up_proj.weight")) continue;
      ++experts;
      const auto* up = w.w13.data() + (2 * e + 1) * kI * kH;
      EXPECT_EQ(f.read_f32(p + "up_proj.weight", {kI, kH}), std::vector<float>(up, up + kI * kH)) << k.name << " " << p;
      const auto* down = w.w2.data() + e * kH * kI;
      EXPECT_EQ(f.read_f32(p + "down_proj.weight", {kH, kI}), std::vector<float>(down, down + kH * kI)) << k.name << " " << p;
    }
  }
  return experts;
}

// Every rank's dumped layer-0 output is what the fp64 reference computes from
// its dumped input with the weights the test wrote (not read back through moed).
void expect_reference_out(const fs::path& dumps, int ranks, int64_t T, const Case& k) {
  const ref::Weights w = ep::reference_weights(k.layers[0]);
  const int K = k.routing.top_k;
  for (int r = 0; r < ranks; ++r) {
    io::SafetensorsReader f((dumps / ("rank" + std::to_string(r) + ".safetensors")).string());
    const std::vector<double> x = to_double(f.read_f32("x", {T, kH}));
    const std::vector<int32_t> idx = f.read_i32("topk_idx", {T, K});
    const ref::Forward own = ref::forward(k.routing, w, x, T);
    for (int64_t t = 0; t < T; ++t) {
      if (own.selection_margin[t] <= 1e-5) continue;  // a near-tie fp32 cannot break like fp64
      for (int j = 0; j < K; ++j) EXPECT_EQ(idx[t * K + j], own.topk_idx[t * K + j]) << k.name << " rank " << r;
    }
    const ref::Forward want = ref::forward(k.routing, w, x, T, ref::forced(idx.data()));
    EXPECT_TRUE(close(k.name + " out of rank " + std::to_string(r), to_double(f.read_f32("out", {T, kH})), want.out,
                      1e-4, 1e-5));
  }
}

std::vector<float> dumped_out(const fs::path& dumps, int ranks, int64_t T) {
  std::vector<float> all;
  for (int r = 0; r < ranks; ++r) {
    const auto v = io::SafetensorsReader((dumps / ("rank" + std::to_string(r) + ".safetensors")).string()).read_f32("out", {T, kH});
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

// Forward and train --verify jobs of every case on one cluster shape; returns
// each case's forward outputs (layer 0, step 0, ranks in order).
std::vector<std::vector<float>> run_shape(int nodes, int devices, int64_t tokens, std::vector<Case>& ks,
                                          const fs::path& root) {
  Cluster c(nodes, devices);
  EXPECT_TRUE(c.up());
  if (!c.up()) return {};
  const int ranks = nodes * devices;
  std::vector<std::vector<float>> outs;
  for (const Case& k : ks) {
    const fs::path dumps = root / ("dump_" + k.name + "_" + std::to_string(ranks));
    std::vector<std::string> fwd = k.flags();
    fwd.insert(fwd.end(), {"--tokens-per-rank", std::to_string(tokens), "--steps", "2", "--dump-dir", dumps.string()});
    run_job(c, fwd);
    EXPECT_EQ(expect_dumped_weights(dumps, ranks, k), kE) << k.name << ": every expert dumped once";
    if (k.shared_width == 0) expect_reference_out(dumps, ranks, tokens, k);  // the check has no shared experts
    outs.push_back(dumped_out(dumps, ranks, tokens));

    std::vector<std::string> train = k.flags();
    train.insert(train.end(), {"--mode", "train", "--tokens-per-rank", std::to_string(tokens), "--steps", "3",
                               "--lr", "0.01"});
    const v1::JobResult r = run_job(c, train);
    EXPECT_EQ(r.loss_size(), 3) << k.name;
    EXPECT_GT(r.loss(0), 0.0) << k.name;
  }
  return outs;
}

TEST(HfWeights, VerifyJobsOnCheckpointsPassOn1x1And2x2) {
  const fs::path root = fs::temp_directory_path() / ("moe_hf_cluster_" + std::to_string(::getpid()));
  fs::remove_all(root);
  std::vector<Case> ks = cases();
  for (Case& k : ks) k.write(root);
  const auto small = run_shape(2, 2, 16, ks, root);
  const auto big = run_shape(1, 1, 64, ks, root);
  ASSERT_EQ(small.size(), ks.size());
  ASSERT_EQ(big.size(), ks.size());
  for (size_t i = 0; i < ks.size(); ++i) {
    ASSERT_EQ(small[i].size(), big[i].size());
    double scale = 0, worst = 0;
    for (size_t j = 0; j < big[i].size(); ++j) {
      scale = std::max(scale, static_cast<double>(std::fabs(big[i][j])));
      worst = std::max(worst, static_cast<double>(std::fabs(big[i][j] - small[i][j])));
    }
    EXPECT_GT(scale, 1e-3) << ks[i].name;
    EXPECT_LT(worst, 1e-5 * scale) << ks[i].name << ": 2x2 and 1x1 outputs differ by " << worst;
  }
  fs::remove_all(root);
}

// Submits a job on k's checkpoint with `extra` flags; returns its failure
// message after checking it failed before step 0.
std::string failed_job_message(const Cluster& c, const Case& k, const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"--output", "json", "job", "submit", "--wait", "--tokens-per-rank", "16", "--steps", "2"};
  for (const std::string& f : k.flags()) args.push_back(f);
  args.insert(args.end(), extra.begin(), extra.end());
  const auto [rc, out] = c.ctl(args, 120s);
  EXPECT_EQ(rc, 1) << out;
  const v1::JobResult r = parse_result(out);
  EXPECT_EQ(r.state(), v1::JOB_STATE_FAILED) << out;
  EXPECT_EQ(r.steps_completed(), 0) << out;
  return r.message();
}

TEST(HfWeights, ABadCheckpointFailsTheJobBeforeStep0NamingTheTensor) {
  const fs::path root = fs::temp_directory_path() / ("moe_hf_bad_" + std::to_string(::getpid()));
  fs::remove_all(root);
  Case k = cases()[1];
  k.write(root);
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());

  // A flag over --hf-config that disagrees with the file's routers: refused at
  // submit, where the agent reads the headers (docs/jobs.md#weights).
  std::vector<std::string> args = {"job", "submit", "--tokens-per-rank", "16", "--steps", "2"};
  for (const std::string& f : k.flags()) args.push_back(f);
  for (const char* f : {"--hidden", "16"}) args.push_back(f);
  const auto [rc, out] = c.ctl(args);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("weights: tensor '" + k.prefix_of(0) + "gate.weight' in "), std::string::npos) << out;
  EXPECT_NE(out.find("has shape [8, 32], the spec gives [8, 16]: experts is 8, hidden is 16"), std::string::npos) << out;

  // Expert 5's up_proj of layer 0 twelve rows wide instead of sixteen, in its shard.
  std::vector<NamedTensor> all;
  for (int l = 0; l < kLayers; ++l)
    for (auto& t : hf_layer_tensors(k.prefix_of(l), k.shape(), k.layers[l], k.scheme)) all.push_back(t);
  const std::string bad = k.prefix_of(0) + "experts.5.up_proj.weight";
  for (NamedTensor& t : all)
    if (t.name == bad) t = {bad, {12, kH}, std::vector<float>(12 * kH, 0.5f)};
  write_hf_checkpoint(k.dir.string(), split(all, k.shards), k.dtype);
  const std::string m = failed_job_message(c, k, {});
  EXPECT_NE(m.find("tensor '" + bad + "' has shape [12, 32], the spec gives [16, 32]: ffn_hidden is 16"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("weights of layer 0 (checkpoint layer 3)"), std::string::npos) << m;
  fs::remove_all(root);
}

}  // namespace
}  // namespace moe::test
