// The training options of docs/layer.md (#balancing, #shared-experts) driven
// through moectl on local clusters: the balancing losses, the aux-loss-free bias
// and shared experts, against the fp64 reference (--verify), across cluster
// shapes, and by what they do to the load.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>

#include "local_cluster.h"
#include "moe/io/safetensors.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;
using Args = std::vector<std::string>;

// Submits a job (--wait, JSON) on c and returns its result; fails on a non-zero exit.
v1::JobResult run_job(const Cluster& c, const Args& spec) {
  Args args = {"--output", "json", "job", "submit", "--wait"};
  args.insert(args.end(), spec.begin(), spec.end());
  const auto [rc, out] = c.ctl(args, 240s);
  EXPECT_EQ(rc, 0) << out << c.logs();
  if (rc != 0) return {};
  const v1::JobResult r = parse_result(out);
  EXPECT_EQ(r.state(), v1::JOB_STATE_SUCCEEDED) << out;
  return r;
}

Args concat(Args a, const Args& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// mean / max of one layer's expert loads: 1 when perfectly balanced.
double expert_balancedness(const v1::JobResult& r, int layer) {
  const auto& t = r.expert_tokens(layer).tokens();
  const double mx = *std::max_element(t.begin(), t.end());
  return std::accumulate(t.begin(), t.end(), 0.0) / t.size() / mx;
}

double max_share(const v1::JobResult& r, int layer) {
  const auto& t = r.expert_tokens(layer).tokens();
  return *std::max_element(t.begin(), t.end()) / std::accumulate(t.begin(), t.end(), 0.0);
}

void expect_close_curves(const char* what, const google::protobuf::RepeatedField<double>& a,
                         const google::protobuf::RepeatedField<double>& b, double rtol) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (int i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], rtol * std::fabs(b[i])) << what << " at step " << i;
}

TEST(Balancing, TwoByTwoLossCurveEqualsOneByOneWithEveryOption) {
  // Every statistic is over the global batch, so 4 ranks of T tokens train exactly
  // as 1 rank of 4T: task loss, aux loss and z-loss step by step.
  const Args spec = {"--mode", "train", "--experts", "8", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "16",
                     "--layers", "2", "--steps", "10", "--seed", "5", "--skew", "zipf:1.0", "--lr", "0.01",
                     "--aux-loss-coeff", "0.05", "--z-loss-coeff", "0.01", "--bias-update-rate", "0.002",
                     "--shared-experts", "2", "--shared-ffn-hidden", "8", "--shared-expert-gate", "--verify"};
  v1::JobResult small, big;
  {
    Cluster c(2, 2);
    ASSERT_TRUE(c.up());
    small = run_job(c, concat(spec, {"--tokens-per-rank", "32"}));
  }
  {
    Cluster c(1, 1);
    ASSERT_TRUE(c.up());
    big = run_job(c, concat(spec, {"--tokens-per-rank", "128"}));
  }
  ASSERT_EQ(small.loss_size(), 10);
  EXPECT_TRUE(small.verify().passed()) << small.DebugString();
  EXPECT_TRUE(big.verify().passed()) << big.DebugString();
  expect_close_curves("loss", small.loss(), big.loss(), 1e-5);
  expect_close_curves("aux_loss", small.aux_loss(), big.aux_loss(), 1e-5);
  expect_close_curves("z_loss", small.z_loss(), big.z_loss(), 1e-5);
  EXPECT_GT(big.aux_loss(0), 0);
  EXPECT_GT(big.z_loss(0), 0);
  EXPECT_LT(big.loss(9), big.loss(0));
}

TEST(Balancing, BiasUpdatesRaiseTheBalancednessOfASkewedForwardJob) {
  // DeepSeek-V3's aux-loss-free balancing works in forward jobs too; verify at the
  // last step checks the layer against the reference with the bias as it moved.
  Cluster c(1, 2);
  ASSERT_TRUE(c.up());
  const Args spec = {"--experts", "16", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "16", "--layers", "2",
                     "--steps", "20", "--tokens-per-rank", "256", "--skew", "zipf:1.5", "--seed", "3"};
  const v1::JobResult fixed = run_job(c, spec);
  const v1::JobResult moving =
      run_job(c, concat(spec, {"--bias-update-rate", "0.05", "--verify", "--verify-step", "19"}));
  EXPECT_TRUE(moving.verify().passed()) << moving.DebugString();
  for (int l = 0; l < 2; ++l) {
    const double before = expert_balancedness(fixed, l), after = expert_balancedness(moving, l);
    EXPECT_GT(after, before + 0.1) << "layer " << l << ": balancedness " << before << " -> " << after;
  }
}

TEST(Balancing, AuxLossLowersTheMaxExpertShare) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  const Args spec = {"--mode", "train", "--experts", "8", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "16",
                     "--steps", "20", "--tokens-per-rank", "256", "--skew", "zipf:1.0", "--seed", "9", "--lr", "0.05"};
  const v1::JobResult plain = run_job(c, spec);
  const v1::JobResult aux = run_job(c, concat(spec, {"--aux-loss-coeff", "1.0"}));
  EXPECT_EQ(plain.aux_loss_size(), 20);
  EXPECT_LT(max_share(aux, 0), max_share(plain, 0) - 0.02)
      << "max expert share " << max_share(plain, 0) << " -> " << max_share(aux, 0);
  EXPECT_LT(aux.aux_loss(19), aux.aux_loss(0));
}

TEST(Balancing, SharedExpertsVerifyOnEveryShapeAndDtype) {
  for (auto [nodes, devices] : {std::pair{1, 1}, std::pair{2, 2}}) {
    Cluster c(nodes, devices);
    ASSERT_TRUE(c.up());
    for (const char* dtype : {"fp32", "bf16"})
      for (bool gate : {false, true}) {
        Args spec = {"--mode", "train", "--experts", "8", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "16",
                     "--steps", "2", "--tokens-per-rank", "24", "--dtype", dtype, "--shared-experts", "1",
                     "--shared-ffn-hidden", "24", "--verify", "--verify-step", "1"};
        if (gate) spec.push_back("--shared-expert-gate");
        const std::filesystem::path dump = c.dir() / (std::string("dump_") + dtype + (gate ? "_gate" : ""));
        const v1::JobResult r = run_job(c, concat(spec, {"--dump-dir", dump.string()}));
        EXPECT_TRUE(r.verify().passed()) << nodes << "x" << devices << " " << dtype << " gate " << gate << "\n"
                                         << r.DebugString();
        // The dump names them as docs/formats.md#dumps says, on every rank (replicated weights).
        const io::SafetensorsReader f((dump / ("rank" + std::to_string(nodes * devices - 1) + ".safetensors")).string());
        for (const char* name : {"shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                                 "shared_experts.down_proj.weight", "grad.shared_experts.gate_proj.weight",
                                 "grad.shared_experts.down_proj.weight"})
          EXPECT_TRUE(f.has(name)) << name;
        EXPECT_EQ(f.has("shared_expert_gate.weight"), gate);
        EXPECT_EQ(f.has("grad.shared_expert_gate.weight"), gate);
      }
  }
}

}  // namespace
}  // namespace moe::test
