// Checkpoint and resume driven through moectl (docs/jobs.md#checkpoints-and-resume):
// a 2x2 run checkpoints at step 5 and 10; resuming step 5 continues its loss curve
// bitwise on 2x2 and within rtol 1e-5 on 1x2 and 1x1 (same global batch); damaged
// checkpoints are refused naming the file or field; bf16 Adam moments resume bitwise.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include <google/protobuf/util/json_util.h>

#include "local_cluster.h"
#include "moe/v1/checkpoint.pb.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using Args = std::vector<std::string>;

// Every option of the training issue on: balancing, bias, shared experts, Adam.
const Args kSpec = {"--mode", "train", "--experts", "8", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "16",
                    "--layers", "2", "--seed", "13", "--skew", "zipf:0.8", "--lr", "0.01",
                    "--aux-loss-coeff", "0.05", "--z-loss-coeff", "0.01", "--bias-update-rate", "0.002",
                    "--shared-experts", "1", "--shared-ffn-hidden", "16", "--shared-expert-gate"};

v1::JobResult submit(const Cluster& c, const Args& args, int expect_rc = 0, std::string* output = nullptr) {
  const auto [rc, out] = c.ctl(concat({"--output", "json", "job", "submit", "--wait"}, args), 180s);
  EXPECT_EQ(rc, expect_rc) << out << (rc != expect_rc ? c.logs() : "");
  if (output) *output = out;
  return rc == 0 || rc == 1 ? parse_result(out) : v1::JobResult{};
}

class Checkpoints : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("moe_ckpt_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    Cluster c(2, 2);
    ASSERT_TRUE(c.up());
    full_ = submit(c, concat(kSpec, {"--steps", "10", "--tokens-per-rank", "32", "--checkpoint-dir", dir_.string(),
                                     "--checkpoint-every", "5"}));
    ASSERT_EQ(full_.loss_size(), 10);
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  // The resumed run's curve against steps 5..9 of the full run.
  static void expect_continues(const v1::JobResult& r, double rtol) {
    ASSERT_EQ(r.loss_size(), 5) << r.DebugString();
    for (int i = 0; i < 5; ++i) {
      if (rtol == 0) {
        EXPECT_EQ(r.loss(i), full_.loss(5 + i)) << "step " << 5 + i;
        EXPECT_EQ(r.aux_loss(i), full_.aux_loss(5 + i)) << "step " << 5 + i;
      } else {
        EXPECT_NEAR(r.loss(i), full_.loss(5 + i), rtol * full_.loss(5 + i)) << "step " << 5 + i;
        EXPECT_NEAR(r.aux_loss(i), full_.aux_loss(5 + i), rtol * full_.aux_loss(5 + i)) << "step " << 5 + i;
      }
    }
    EXPECT_EQ(r.steps_completed(), 10);
  }

  static inline fs::path dir_;
  static inline v1::JobResult full_;
};

TEST_F(Checkpoints, ShowListsStepSpecMapsAndBytesPerRank) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  auto [rc, out] = c.ctl({"checkpoint", "show", dir_.string()});  // the latest complete step
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("step-000010"), std::string::npos) << out;
  EXPECT_NE(out.find("rank3.safetensors"), std::string::npos) << out;
  EXPECT_NE(out.find("router.safetensors"), std::string::npos) << out;
  std::tie(rc, out) = c.ctl({"--output", "json", "checkpoint", "show", (dir_ / "step-000005").string()});
  ASSERT_EQ(rc, 0) << out;
  v1::CheckpointManifest m;
  ASSERT_TRUE(parse_output(out, m));
  EXPECT_EQ(m.step(), 5);
  EXPECT_EQ(m.world_size(), 4);
  EXPECT_EQ(m.maps_size(), 2);
  EXPECT_EQ(m.files_size(), 5);
  for (const auto& f : m.files()) EXPECT_GT(f.bytes(), 0) << f.name();
}

TEST_F(Checkpoints, ResumeOnTheSameShapeIsBitwise) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up());
  // Only what changes is given: the model, routing and training fields come from
  // the checkpoint's spec; an empty --checkpoint-dir writes no checkpoints.
  const v1::JobResult r = submit(c, {"--steps", "10", "--tokens-per-rank", "32", "--resume",
                                     (dir_ / "step-000005").string(), "--verify", "--checkpoint-dir", ""});
  expect_continues(r, 0.0);
  // Verify covers the resumed run's first step (step 5), on the loaded state.
  EXPECT_TRUE(r.verify().passed()) << r.DebugString();
  EXPECT_GT(r.verify().max_abs_error(), 0.0) << "verify compared nothing";
}

TEST_F(Checkpoints, ResumeOnOtherShapesKeepsTheCurve) {
  for (auto [nodes, devices, tokens] : {std::tuple{1, 2, "64"}, std::tuple{1, 1, "128"}}) {
    Cluster c(nodes, devices);
    ASSERT_TRUE(c.up());
    SCOPED_TRACE(std::to_string(nodes) + "x" + std::to_string(devices));
    // The flags may repeat the checkpoint's spec (they equal it).
    expect_continues(submit(c, concat(kSpec, {"--steps", "10", "--tokens-per-rank", tokens, "--resume",
                                              (dir_ / "step-000005").string(), "--checkpoint-dir", ""})),
                     1e-5);
  }
}

TEST_F(Checkpoints, ResumeAfterALiveRebalanceKeepsTheCurve) {
  // The checkpoint at step 100 holds the map a live rebalance installed at
  // about step 3 (replicas moved experts); resuming installs it again.
  const fs::path dir = dir_.parent_path() / (dir_.filename().string() + "_rebalanced");
  fs::remove_all(dir);
  Cluster c(2, 2);
  ASSERT_TRUE(c.up());
  const Args spec = concat(kSpec, {"--steps", "200", "--tokens-per-rank", "32"});
  auto [rc, out] = c.ctl(concat(concat({"job", "submit"}, spec), {"--checkpoint-dir", dir.string(), "--checkpoint-every", "100"}));
  ASSERT_EQ(rc, 0) << out;
  const std::string id = out.substr(0, out.find('\n'));
  ASSERT_TRUE(poll_until([&] { return c.job(id).steps_completed() >= 3; }, 60s)) << c.logs();
  std::tie(rc, out) = c.ctl({"placement", "rebalance", "--redundant-experts", "4"}, 120s);
  ASSERT_EQ(rc, 0) << out << c.logs();
  std::tie(rc, out) = c.ctl({"--output", "json", "job", "wait", id}, 180s);
  ASSERT_EQ(rc, 0) << out << c.logs();
  const v1::JobResult full = parse_result(out);
  ASSERT_EQ(full.loss_size(), 200);
  std::tie(rc, out) = c.ctl({"--output", "json", "checkpoint", "show", (dir / "step-000100").string()});
  ASSERT_EQ(rc, 0) << out;
  v1::CheckpointManifest m;
  ASSERT_TRUE(parse_output(out, m));
  EXPECT_EQ(m.maps(0).slots_per_rank(), 3) << "the checkpoint holds the rebalanced map (8 + 4 replicas on 4 ranks)";
  const v1::JobResult resumed =
      submit(c, concat(spec, {"--resume", (dir / "step-000100").string(), "--verify", "--checkpoint-dir", ""}));
  ASSERT_EQ(resumed.loss_size(), 100);
  EXPECT_TRUE(resumed.verify().passed()) << resumed.DebugString();
  for (int i = 0; i < 100; ++i) EXPECT_NEAR(resumed.loss(i), full.loss(100 + i), 1e-5 * full.loss(100 + i)) << 100 + i;
  fs::remove_all(dir);
}

TEST_F(Checkpoints, DamagedOrMismatchedCheckpointsAreRefusedNamingTheProblem) {
  const fs::path bad = dir_.parent_path() / (dir_.filename().string() + "_bad");
  fs::remove_all(bad);
  fs::create_directories(bad);
  fs::copy(dir_ / "step-000005", bad / "step-000005", fs::copy_options::recursive);
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  std::string out;
  // A truncated rank file: refused at submit (exit 2), no job recorded.
  fs::resize_file(bad / "step-000005" / "rank2.safetensors", fs::file_size(bad / "step-000005" / "rank2.safetensors") / 2);
  const Args resume = {"--steps", "10", "--tokens-per-rank", "128", "--resume", bad.string()};
  submit(c, resume, 2, &out);
  EXPECT_NE(out.find("rank2.safetensors is truncated"), std::string::npos) << out;
  auto [rc, show] = c.ctl({"checkpoint", "show", bad.string()});
  EXPECT_EQ(rc, 2);
  EXPECT_NE(show.find("rank2.safetensors is truncated"), std::string::npos) << show;
  // A missing one.
  fs::remove(bad / "step-000005" / "rank2.safetensors");
  submit(c, resume, 2, &out);
  EXPECT_NE(out.find("rank2.safetensors is missing"), std::string::npos) << out;
  // A spec that differs in a field that may not change.
  submit(c, {"--steps", "10", "--resume", (dir_ / "step-000005").string(), "--dtype", "bf16"}, 2, &out);
  EXPECT_NE(out.find("resume: dtype is bf16 but the checkpoint was written with fp32"), std::string::npos) << out;
  // No --steps: required; fewer than the checkpoint holds: refused, naming both.
  submit(c, {"--resume", (dir_ / "step-000005").string()}, 2, &out);
  EXPECT_NE(out.find("steps: required (--steps)"), std::string::npos) << out;
  submit(c, {"--resume", (dir_ / "step-000005").string(), "--steps", "3"}, 2, &out);
  EXPECT_NE(out.find("steps: the checkpoint has 5 steps done and the job asks for 3"), std::string::npos) << out;
  // A half-written step folder (no checkpoint.json) is never taken.
  fs::remove(bad / "step-000005" / "checkpoint.json");
  submit(c, resume, 2, &out);
  EXPECT_NE(out.find("holds no complete checkpoint"), std::string::npos) << out;
  // None of these became a job.
  EXPECT_NE(c.ctl({"job", "list"}).second.find("no jobs yet"), std::string::npos);
  fs::remove_all(bad);
}

// bf16 Adam moments (--moments-dtype bf16): checkpoints keep them widened to fp32
// (exactly), so a resume continues bitwise; the curve stays near fp32 moments'
// without equalling it; a job that keeps no moments refuses the flag.
TEST_F(Checkpoints, Bf16MomentsResumeBitwiseAndTrainLikeFp32Moments) {
  const fs::path dir = dir_.parent_path() / (dir_.filename().string() + "_bf16_moments");
  fs::remove_all(dir);
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  const Args small = concat(kSpec, {"--tokens-per-rank", "64", "--steps", "8"});
  const v1::JobResult bf16 = submit(
      c, concat(small, {"--moments-dtype", "bf16", "--checkpoint-dir", dir.string(), "--checkpoint-every", "4"}));
  const v1::JobResult fp32 = submit(c, concat(small, {"--checkpoint-dir", ""}));
  ASSERT_EQ(bf16.loss_size(), 8);
  ASSERT_EQ(fp32.loss_size(), 8);
  bool differs = false;
  for (int i = 0; i < 8; ++i) {
    EXPECT_NEAR(bf16.loss(i), fp32.loss(i), 0.02 * fp32.loss(i)) << "step " << i;
    differs = differs || bf16.loss(i) != fp32.loss(i);
  }
  EXPECT_TRUE(differs) << "bf16 moments changed no loss";
  const v1::JobResult resumed = submit(c, {"--steps", "8", "--tokens-per-rank", "64", "--resume",
                                           (dir / "step-000004").string(), "--checkpoint-dir", ""});
  ASSERT_EQ(resumed.loss_size(), 4) << resumed.DebugString();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(resumed.loss(i), bf16.loss(4 + i)) << "step " << 4 + i;
  std::string out;
  submit(c, {"--experts", "8", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "16", "--tokens-per-rank", "8",
             "--steps", "1", "--moments-dtype", "bf16"},
         2, &out);
  EXPECT_NE(out.find("moments_dtype: bf16 moments need a train job with the adam optimizer"), std::string::npos) << out;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moe::test
