// The same job gives the same bits (docs/layer.md#overlap): a train job's loss
// curve, bit for bit, at every chunk count of the overlapped dispatch/combine
// (fixed and chosen per step by the rule), when submitted twice, with replicas,
// and across a live rebalance; fp32 and bf16.
// Real processes: a 2x2 local cluster, moectl, UCX between the daemons. The
// numeric run with the narrowest ISA forced runs it too (deploy/local/test.sh).
#include <gtest/gtest.h>

#include "local_cluster.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;

v1::JobResult train(const Cluster& c, const std::string& dtype, const std::string& chunks,
                    const std::vector<std::string>& more = {}) {
  const auto [rc, out] = c.ctl(concat({"--output", "json", "job", "submit", "--wait", "--mode", "train", "--experts", "16",
                                       "--top-k", "4", "--hidden", "128", "--ffn-hidden", "64", "--tokens-per-rank",
                                       "256", "--skew", "zipf:1.0", "--lr", "0.01", "--steps", "8", "--dtype", dtype,
                                       "--overlap-chunks", chunks, "--exact-replica-grads"},
                                      more),
                               120s);
  EXPECT_EQ(rc, 0) << out << c.logs();
  return parse_result(out);
}

TEST(Determinism, ATrainJobGivesTheSameBitsAtEveryChunkCountAndWhenRunTwice) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up());
  for (const std::string dtype : {"fp32", "bf16"}) {
    SCOPED_TRACE(dtype);
    const v1::JobResult serial = train(c, dtype, "1");
    ASSERT_EQ(serial.state(), v1::JOB_STATE_SUCCEEDED) << serial.message();
    ASSERT_EQ(serial.loss_size(), 8);
    // The last: replicas on both nodes, each expert's gradient taken over all its pairs.
    for (const std::string chunks : {"2", "4", "0", "0", "replicas"}) {
      // The shape keeps the replicas' map for the jobs after it (the next dtype's
      // too): exact replica gradients give them the same bits.
      const v1::JobResult r = chunks == "replicas" ? train(c, dtype, "0", {"--min-node-replicas", "2"})
                                                   : train(c, dtype, chunks);
      ASSERT_EQ(r.state(), v1::JOB_STATE_SUCCEEDED) << r.message();
      if (chunks != "0" && chunks != "replicas") {
        EXPECT_EQ(r.overlap_chunks(), std::stoi(chunks));
      }
      ASSERT_EQ(r.loss_size(), serial.loss_size());
      for (int s = 0; s < r.loss_size(); ++s)
        EXPECT_EQ(r.loss(s), serial.loss(s)) << "--overlap-chunks " << chunks << " (ran " << r.overlap_chunks()
                                             << "), step " << s;
    }
  }
}

// docs/layer.md#determinism: where an expert lives changes no bit, so a live
// rebalance mid-job leaves the loss curve's bits, whether it only moves experts
// or adds replicas of the hot ones (with exact replica gradients).
TEST(Determinism, ALiveRebalanceKeepsTheBits) {
  for (const auto& [dtype, redundant] : {std::pair{"fp32", "0"}, {"bf16", "0"}, {"fp32", "4"}, {"bf16", "4"}}) {
    SCOPED_TRACE(std::string(dtype) + ", redundant experts " + redundant);
    Cluster c(2, 2);  // a fresh one: no map left from the last rebalance
    ASSERT_TRUE(c.up());
    const std::vector<std::string> job = {"--mode", "train", "--experts", "16", "--top-k", "4", "--hidden", "128",
                                          "--ffn-hidden", "64", "--tokens-per-rank", "256", "--skew", "zipf:1.2",
                                          "--lr", "0.01", "--steps", "40", "--dtype", dtype, "--overlap-chunks", "0",
                                          "--exact-replica-grads"};
    auto [rc, out] = c.ctl(concat({"--output", "json", "job", "submit", "--wait"}, job), 120s);
    ASSERT_EQ(rc, 0) << out << c.logs();
    const v1::JobResult plain = parse_result(out);
    std::tie(rc, out) = c.ctl(concat({"job", "submit"}, job));
    ASSERT_EQ(rc, 0) << out;
    const std::string id = out.substr(0, out.find('\n'));
    ASSERT_TRUE(poll_until([&] { return c.job(id).steps_completed() >= 3; }, 60s)) << c.logs();
    std::tie(rc, out) = c.ctl({"placement", "rebalance", "--redundant-experts", redundant}, 60s);
    ASSERT_EQ(rc, 0) << out << c.logs();
    EXPECT_NE(out.find("rebalance committed"), std::string::npos) << out;
    std::tie(rc, out) = c.ctl({"--output", "json", "job", "wait", id}, 120s);
    const v1::JobResult moved = parse_result(out);
    ASSERT_EQ(moved.state(), v1::JOB_STATE_SUCCEEDED) << moved.message() << c.logs();
    EXPECT_EQ(moved.epochs_size(), 2) << "the rebalance landed mid-job";
    ASSERT_EQ(moved.loss_size(), plain.loss_size());
    for (int s = 0; s < moved.loss_size(); ++s) EXPECT_EQ(moved.loss(s), plain.loss(s)) << "step " << s;
  }
}

}  // namespace
}  // namespace moe::test
