// `moectl job submit --hf-config`: each model family's config.json keys map onto
// the spec; a config of an unknown type or without a needed key is an error
// naming the key; -f spec.json and flags override the config.
#include <gtest/gtest.h>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <fstream>

#include "moe/ctl/hf_config.h"
#include "moe/ctl/job_flags.h"
#include "moe/rpc/frame.h"

namespace moe::test {
namespace {

namespace fs = std::filesystem;

ctl::HfModel parse(const std::string& json) { return ctl::hf_model_from_config(json, "config.json"); }

// json with its one `from` replaced by `to`.
std::string with(std::string json, const std::string& from, const std::string& to) {
  const size_t at = json.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return at == std::string::npos ? json : json.replace(at, from.size(), to);
}

std::string error_of(const std::string& json) {
  try {
    parse(json);
  } catch (const moe::InvalidArgument& e) {
    return e.what();
  }
  return "";
}

// Trimmed from the published configs of each model.
const char* kMixtral = R"({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
  "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
  "router_aux_loss_coef": 0.02, "torch_dtype": "bfloat16"})";
const char* kQwen2 = R"({"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts": 60,
  "num_experts_per_tok": 4, "norm_topk_prob": false, "decoder_sparse_step": 1, "mlp_only_layers": []})";
const char* kQwen3 = R"({"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
  "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true})";
const char* kDeepSeekV2Lite = R"({"model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
  "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
  "first_k_dense_replace": 1, "norm_topk_prob": false, "scoring_func": "softmax", "topk_method": "greedy",
  "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0})";
const char* kDeepSeekV3 = R"({"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
  "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
  "first_k_dense_replace": 3, "norm_topk_prob": true, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
  "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "moe_layer_freq": 1})";

TEST(HfConfig, Mixtral) {
  const ctl::HfModel m = parse(kMixtral);
  EXPECT_EQ(m.spec.experts(), 8);
  EXPECT_EQ(m.spec.top_k(), 2);
  EXPECT_EQ(m.spec.hidden(), 4096);
  EXPECT_EQ(m.spec.ffn_hidden(), 14336);
  EXPECT_EQ(m.spec.score(), v1::JobSpec::softmax);
  EXPECT_TRUE(m.spec.norm_topk_prob());
  EXPECT_EQ(m.spec.routed_scaling_factor(), 1.0);
  EXPECT_EQ(m.spec.shared_experts(), 0);
  EXPECT_EQ(m.weights_prefix, "model.layers.{layer}.block_sparse_moe.");
  EXPECT_EQ(m.weights_first_layer, 0);
}

TEST(HfConfig, Qwen2MoeHasOneGatedSharedExpert) {
  const ctl::HfModel m = parse(kQwen2);
  EXPECT_EQ(m.spec.experts(), 60);
  EXPECT_EQ(m.spec.top_k(), 4);
  EXPECT_EQ(m.spec.hidden(), 2048);
  EXPECT_EQ(m.spec.ffn_hidden(), 1408);
  EXPECT_FALSE(m.spec.norm_topk_prob());
  EXPECT_EQ(m.spec.shared_experts(), 1);
  EXPECT_EQ(m.spec.shared_ffn_hidden(), 5632);
  EXPECT_TRUE(m.spec.shared_expert_gate());
  EXPECT_EQ(m.weights_prefix, "model.layers.{layer}.mlp.");
}

TEST(HfConfig, Qwen3Moe) {
  const ctl::HfModel m = parse(kQwen3);
  EXPECT_EQ(m.spec.experts(), 128);
  EXPECT_EQ(m.spec.top_k(), 8);
  EXPECT_EQ(m.spec.ffn_hidden(), 768);
  EXPECT_TRUE(m.spec.norm_topk_prob());
  EXPECT_EQ(m.spec.shared_experts(), 0);
  EXPECT_FALSE(m.spec.shared_expert_gate());
  // Without the key, Hugging Face's default (false).
  std::string no_norm = kQwen3;
  no_norm = with(no_norm, ", \"norm_topk_prob\": true", "");
  EXPECT_FALSE(parse(no_norm).spec.norm_topk_prob());
}

TEST(HfConfig, DeepSeekV2) {
  const ctl::HfModel m = parse(kDeepSeekV2Lite);
  EXPECT_EQ(m.spec.experts(), 64);
  EXPECT_EQ(m.spec.top_k(), 6);
  EXPECT_EQ(m.spec.ffn_hidden(), 1408);
  EXPECT_EQ(m.spec.score(), v1::JobSpec::softmax);
  EXPECT_EQ(m.spec.num_groups(), 0) << "greedy ignores the groups";
  EXPECT_FALSE(m.spec.norm_topk_prob());
  EXPECT_EQ(m.spec.shared_experts(), 2);
  EXPECT_EQ(m.spec.shared_ffn_hidden(), 1408);
  EXPECT_FALSE(m.spec.shared_expert_gate());
  EXPECT_EQ(m.weights_first_layer, 1);
  // V2 scales only weights it does not renormalise.
  std::string v2 = kDeepSeekV2Lite;
  v2 = with(v2, "\"routed_scaling_factor\": 1.0", "\"routed_scaling_factor\": 16.0");
  EXPECT_EQ(parse(v2).spec.routed_scaling_factor(), 16.0);
  v2 = with(v2, "\"norm_topk_prob\": false", "\"norm_topk_prob\": true");
  EXPECT_EQ(parse(v2).spec.routed_scaling_factor(), 1.0);
  // Its group-limited routing ranks groups differently: refused, naming the key.
  std::string grouped = kDeepSeekV2Lite;
  grouped = with(grouped, "\"greedy\"", "\"group_limited_greedy\"");
  EXPECT_NE(error_of(grouped).find("'topk_method' 'group_limited_greedy'"), std::string::npos) << error_of(grouped);
}

TEST(HfConfig, DeepSeekV3) {
  const ctl::HfModel m = parse(kDeepSeekV3);
  EXPECT_EQ(m.spec.experts(), 256);
  EXPECT_EQ(m.spec.top_k(), 8);
  EXPECT_EQ(m.spec.hidden(), 7168);
  EXPECT_EQ(m.spec.ffn_hidden(), 2048);
  EXPECT_EQ(m.spec.score(), v1::JobSpec::sigmoid);
  EXPECT_EQ(m.spec.num_groups(), 8);
  EXPECT_EQ(m.spec.group_top_k(), 4);
  EXPECT_TRUE(m.spec.norm_topk_prob());
  EXPECT_EQ(m.spec.routed_scaling_factor(), 2.5);
  EXPECT_EQ(m.spec.shared_experts(), 1);
  EXPECT_EQ(m.spec.shared_ffn_hidden(), 2048);
  EXPECT_EQ(m.weights_first_layer, 3);
  EXPECT_EQ(m.weights_prefix, "model.layers.{layer}.mlp.");
}

TEST(HfConfig, ErrorsNameTheKey) {
  EXPECT_NE(error_of(R"({"model_type": "llama", "hidden_size": 4096})").find("'model_type' 'llama' is not a family"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"hidden_size": 4096})").find("'model_type' is missing"), std::string::npos);
  std::string no_width = kQwen2;
  no_width = with(no_width, "\"moe_intermediate_size\": 1408, ", "");
  EXPECT_NE(error_of(no_width).find("config.json: 'moe_intermediate_size' is missing (needed for model_type 'qwen2_moe')"),
            std::string::npos)
      << error_of(no_width);
  std::string text_count = kMixtral;
  text_count = with(text_count, "\"num_local_experts\": 8", "\"num_local_experts\": \"8\"");
  EXPECT_NE(error_of(text_count).find("'num_local_experts' must be a non-negative integer"), std::string::npos);
  std::string v3 = kDeepSeekV3;
  v3 = with(v3, "\"n_group\": 8, ", "");
  EXPECT_NE(error_of(v3).find("'n_group' is missing"), std::string::npos) << error_of(v3);
  v3 = kDeepSeekV3;
  v3 = with(v3, "\"sigmoid\"", "\"tanh\"");
  EXPECT_NE(error_of(v3).find("'scoring_func' must be softmax or sigmoid, got 'tanh'"), std::string::npos);
  EXPECT_NE(error_of("[1").find("config.json: not a JSON object"), std::string::npos);
}

// Through moectl's flags: the config, -f spec.json over it, flags over both.
class HfConfigFlags : public ::testing::Test {
 protected:
  fs::path dir = fs::temp_directory_path() / ("moe_hfcfg_" + std::to_string(::getpid()));
  void SetUp() override { fs::create_directories(dir); }
  void TearDown() override { fs::remove_all(dir); }
  std::string file(const std::string& name, const std::string& text) const {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  }
  static v1::JobSpec build(const std::string& args) {
    CLI::App app;
    ctl::JobFlags flags;
    flags.add(&app);
    app.parse(args, false);
    return flags.build();
  }
};

TEST_F(HfConfigFlags, FileAndFlagsOverrideTheConfig) {
  const std::string config = file("config.json", kDeepSeekV3);
  const std::string weights = file("model.safetensors", "");
  v1::JobSpec s = build("--hf-config " + config + " --tokens-per-rank 8 --steps 1");
  EXPECT_EQ(s.experts(), 256);
  EXPECT_EQ(s.weights_prefix(), "") << "no weights, no prefix";
  EXPECT_EQ(s.weights_first_layer(), 0);
  EXPECT_EQ(s.tokens_per_rank(), 8);

  const std::string spec = file("spec.json", R"({"experts": 64, "num_groups": 0, "groupTopK": 0, "weights": ")" +
                                                 weights + R"("})");
  s = build("--hf-config " + config + " -f " + spec + " --top-k 4 --weights-first-layer 5");
  EXPECT_EQ(s.experts(), 64) << "the file over the config";
  EXPECT_EQ(s.num_groups(), 0) << "a zero in the file overrides too";
  EXPECT_EQ(s.group_top_k(), 0);
  EXPECT_EQ(s.top_k(), 4) << "a flag over the config";
  EXPECT_EQ(s.hidden(), 7168) << "the config where neither says";
  EXPECT_EQ(s.score(), v1::JobSpec::sigmoid);
  EXPECT_EQ(s.weights_prefix(), "model.layers.{layer}.mlp.") << "the config's prefix with weights";
  EXPECT_EQ(s.weights_first_layer(), 5) << "a flag over first_k_dense_replace";
  EXPECT_EQ(s.weights(), weights);
}

TEST_F(HfConfigFlags, ARelativeWeightsPathBecomesAbsolute) {
  const v1::JobSpec s = build("--weights ckpt/model.safetensors");
  EXPECT_EQ(s.weights(), (fs::current_path() / "ckpt/model.safetensors").string());
}

}  // namespace
}  // namespace moe::test
