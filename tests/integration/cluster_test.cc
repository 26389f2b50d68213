// The cluster as a user runs it: moectl, moe-agent and moed as real processes on
// loopback, each test with its own state directory.
#include <gtest/gtest.h>

#include <map>

#include <arpa/inet.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <google/protobuf/util/json_util.h>

#include <cmath>

#include "moe/io/safetensors.h"
#include "moe/v1/rpc.pb.h"
#include "local_cluster.h"
#include "process.h"
#include "moe/rpc/frame.h"
#include "moe/rpc/client.h"

#ifndef MOE_BIN_DIR
#error "MOE_BIN_DIR must name the build directory"
#endif

namespace moe::test {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

const std::string kMoed = std::string(MOE_BIN_DIR) + "/daemon/moed";

// out of layer 0 at step 0 from a dump directory, ranks concatenated in order.
std::vector<float> dumped_out(const fs::path& dir, int ranks, int64_t T, int H) {
  std::vector<float> all;
  for (int r = 0; r < ranks; ++r) {
    io::SafetensorsReader f((dir / ("rank" + std::to_string(r) + ".safetensors")).string());
    const auto v = f.read_f32("out", {T, H});
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

TEST(Cluster, TwoByTwoEqualsOneByOneWithFourTimesTheTokens) {
  const fs::path dumps = fs::temp_directory_path() / ("moe_equiv_" + std::to_string(::getpid()));
  fs::remove_all(dumps);
  const std::vector<std::string> spec = {"--experts", "8", "--top-k", "3", "--hidden", "64", "--ffn-hidden", "32",
                                         "--layers", "2", "--steps", "2", "--seed", "7", "--skew", "zipf:0.8", "--verify"};
  std::vector<float> big, small;
  {
    Cluster c(2, 2);
    ASSERT_TRUE(c.up());
    std::vector<std::string> args = {"--output", "json", "job", "submit", "--wait", "--tokens-per-rank", "48",
                                     "--dump-dir", (dumps / "2x2").string()};
    args.insert(args.end(), spec.begin(), spec.end());
    const auto [rc, out] = c.ctl(args, 120s);
    ASSERT_EQ(rc, 0) << out << c.logs();
    EXPECT_NE(out.find("\"state\": \"SUCCEEDED\""), std::string::npos) << out;
    EXPECT_NE(out.find("\"passed\": true"), std::string::npos) << out;
    EXPECT_NE(out.find("\"steps_completed\": 2"), std::string::npos) << out;
    small = dumped_out(dumps / "2x2", 4, 48, 64);
    EXPECT_TRUE(fs::exists(dumps / "2x2" / "spec.json"));
  }
  {
    Cluster c(1, 1);
    ASSERT_TRUE(c.up());
    std::vector<std::string> args = {"job", "submit", "--wait", "--tokens-per-rank", "192", "--dump-dir", (dumps / "1x1").string()};
    args.insert(args.end(), spec.begin(), spec.end());
    const auto [rc, out] = c.ctl(args, 120s);
    ASSERT_EQ(rc, 0) << out << c.logs();
    big = dumped_out(dumps / "1x1", 1, 192, 64);
  }
  ASSERT_EQ(small.size(), big.size());
  double scale = 0, worst = 0;
  for (size_t i = 0; i < big.size(); ++i) {
    scale = std::max(scale, static_cast<double>(std::fabs(big[i])));
    worst = std::max(worst, static_cast<double>(std::fabs(big[i] - small[i])));
  }
  EXPECT_GT(scale, 1e-3);
  EXPECT_LT(worst, 1e-5 * scale) << "2x2 and 1x1 outputs differ by " << worst;
  fs::remove_all(dumps);
}

TEST(Cluster, TrainJobVerifiesGradientsAndHalvesTheLossByStep20) {
  // docs/jobs.md#teacher-and-loss: the student learns a teacher built from seed + 1;
  // the step-20 loss is at most half the step-0 loss. A small hidden size, so that
  // 20 Adam steps can learn much of a random teacher (docs/benchmarks.md#cluster-jobs-beside-the-bare-layer).
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const auto [rc, out] = c.ctl({"--output", "json", "job", "submit", "--wait", "--mode", "train", "--experts", "16",
                                "--top-k", "4", "--hidden", "16", "--ffn-hidden", "16", "--tokens-per-rank", "1024",
                                "--layers", "2", "--steps", "21", "--lr", "0.05", "--verify"},
                               180s);
  ASSERT_EQ(rc, 0) << out << c.logs();
  const v1::JobResult r = parse_result(out);
  ASSERT_EQ(r.loss_size(), 21) << out;
  EXPECT_GT(r.loss(0), 0.0);
  EXPECT_LE(r.loss(20), 0.5 * r.loss(0)) << out;
  EXPECT_TRUE(r.verify().passed()) << out;  // forward and gradients against the fp64 reference
  EXPECT_GT(r.phase_seconds().backward(), 0.0);
  EXPECT_GT(r.phase_seconds().optimizer(), 0.0);
  // The layer's own speed leaves out the synthetic teacher and inputs (docs/jobs.md#result).
  EXPECT_GT(r.phase_seconds().teacher(), 0.0);
  EXPECT_GT(r.layer_step_seconds_p50(), 0.0);
  EXPECT_LT(r.layer_step_seconds_p50(), r.step_seconds_p50());
  EXPECT_GT(r.layer_tokens_per_second(), r.tokens_per_second());
  const auto [status_rc, status_text] = c.ctl({"job", "status", r.job_id()});
  EXPECT_EQ(status_rc, 0) << status_text;
  EXPECT_NE(status_text.find("layer tokens/s"), std::string::npos) << status_text;

  // Each daemon's Prometheus endpoint: expert load, and both directions of the
  // all-to-alls (docs/metrics.md#daemon-metrics).
  v1::Envelope status;
  status.mutable_cluster_status();
  const v1::ClusterStatus st = c.client().call(status, 10s).cluster_status_reply();
  ASSERT_EQ(st.nodes_size(), 2);
  for (const v1::NodeInfo& n : st.nodes()) {
    // Registered as HOST:PORT (docs/metrics.md#service-discovery).
    const std::string text = scrape(n.metrics_address());
    EXPECT_NE(text.find("moe_expert_tokens_total{expert=\"0\",layer=\"0\""), std::string::npos) << text;
    EXPECT_NE(text.find("moe_build_info{backend=\"cpu\",gemm_engine=\""), std::string::npos) << text;
    // A rank's load is the pairs its experts computed, per layer; over both
    // layers and every step it equals what the job's result reports.
    for (int l = 0; l < 2; ++l) {
      const std::string rank = std::to_string(n.node_index());
      EXPECT_EQ(series_value(text, "moe_rank_tokens_total{layer=\"" + std::to_string(l) + "\",rank=\"" + rank + "\"}"),
                r.layer_rank_tokens(l).tokens(n.node_index()))
          << n.name() << " layer " << l;
    }
    EXPECT_GT(series_value(text, "moe_naive_transport_bytes_total{op=\"combine\"}"), 0) << n.name();
    // Communication per layer and rank (docs/metrics.md#ranks-across-worlds):
    // each node's one device is rank node_index here.
    const std::string rank = std::to_string(n.node_index());
    for (const char* direction : {"forward", "backward"}) {
      const std::string d = std::string("direction=\"") + direction + "\"";
      EXPECT_EQ(series_value(text, "moe_expert_compute_seconds_count{" + d + "}"), 2 * 21) << n.name() << " " << d;
      for (int l = 0; l < 2; ++l) {
        const std::string at = "{device=\"0\"," + d + ",layer=\"" + std::to_string(l) + "\"";
        const std::string series = at + ",rank=\"" + rank + "\"}";
        EXPECT_EQ(series_value(text, "moe_dispatch_seconds_count" + series), 21) << n.name() << series << text;
        EXPECT_EQ(series_value(text, "moe_combine_seconds_count" + series), 21) << n.name() << series;
        for (const char* op : {"dispatch", "combine"}) {
          const std::string labels = at + ",op=\"" + op + "\",rank=\"" + rank + "\"}";
          EXPECT_GT(series_value(text, "moe_transport_bytes_total" + labels), 0) << n.name() << " " << labels;
          EXPECT_GT(series_value(text, "moe_transport_received_bytes_total" + labels), 0) << n.name() << " " << labels;
        }
      }
    }
  }
  // The load is (token, expert) pairs: K per token per layer and step in all,
  // which deduplicated rows are not (docs/placement.md#load-and-balancedness).
  double pairs = 0;
  for (double v : r.rank_tokens()) pairs += v;
  EXPECT_EQ(pairs, 2.0 * 1024 * 4 * 2 * 21) << out;
  double rows = 0;
  for (double v : r.rank_received_rows()) rows += v;
  EXPECT_LT(rows, pairs) << out;
}

// A train job whose values stop being finite fails at that step, naming it and the
// ranks, instead of ending SUCCEEDED with a nan loss. lr 1e30 makes step 0's Adam
// update put every weight near 1e30, so step 1's expert outputs overflow fp32.
TEST(Cluster, ANonFiniteLossFailsTheJobNamingTheStep) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const auto [rc, out] = c.ctl({"--output", "json", "job", "submit", "--wait", "--mode", "train", "--experts", "8",
                                "--top-k", "2", "--hidden", "16", "--ffn-hidden", "16", "--tokens-per-rank", "64",
                                "--steps", "4", "--lr", "1e30"},
                               120s);
  ASSERT_EQ(rc, 1) << out << c.logs();
  const v1::JobResult r = parse_result(out);
  EXPECT_EQ(r.state(), v1::JOB_STATE_FAILED) << out;
  EXPECT_NE(r.message().find("step 1: not finite on rank(s) 0, 1"), std::string::npos) << r.message();
  EXPECT_TRUE(std::isfinite(r.loss(0))) << out;  // step 0 was fine
}

TEST(Cluster, TwoByTwoTrainGradientsEqualOneByOne) {
  // Distributed backward: router and expert gradients summed over ranks (and
  // replicas) equal a single rank's over the same global tokens.
  const fs::path dumps = fs::temp_directory_path() / ("moe_train_equiv_" + std::to_string(::getpid()));
  fs::remove_all(dumps);
  const std::vector<std::string> spec = {"--mode", "train", "--experts", "8", "--top-k", "3", "--hidden", "32",
                                         "--ffn-hidden", "16", "--steps", "1", "--seed", "11", "--skew", "zipf:0.5"};
  auto run = [&](int nodes, int devices, int64_t tokens, const std::string& name) {
    Cluster c(nodes, devices);
    ASSERT_TRUE(c.up());
    std::vector<std::string> args = {"job", "submit", "--wait", "--tokens-per-rank", std::to_string(tokens),
                                     "--dump-dir", (dumps / name).string()};
    args.insert(args.end(), spec.begin(), spec.end());
    const auto [rc, out] = c.ctl(args, 120s);
    ASSERT_EQ(rc, 0) << out << c.logs();
  };
  run(2, 2, 24, "2x2");
  run(1, 1, 96, "1x1");
  io::SafetensorsReader one((dumps / "1x1" / "rank0.safetensors").string());
  double worst = 0, scale = 0;
  auto cmp = [&](const std::vector<float>& a, const std::vector<float>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::fabs(a[i] - b[i])));
      scale = std::max(scale, static_cast<double>(std::fabs(b[i])));
    }
  };
  int experts_seen = 0;
  for (int r = 0; r < 4; ++r) {
    io::SafetensorsReader f((dumps / "2x2" / ("rank" + std::to_string(r) + ".safetensors")).string());
    cmp(f.read_f32("grad.gate.weight", {8, 32}), one.read_f32("grad.gate.weight", {8, 32}));
    for (int e = 0; e < 8; ++e) {
      const std::string name = "grad.experts." + std::to_string(e) + ".down_proj.weight";
      if (!f.has(name)) continue;
      ++experts_seen;
      cmp(f.read_f32(name, {32, 16}), one.read_f32(name, {32, 16}));
      const std::string up = "grad.experts." + std::to_string(e) + ".up_proj.weight";
      cmp(f.read_f32(up, {16, 32}), one.read_f32(up, {16, 32}));
    }
  }
  EXPECT_GE(experts_seen, 8);
  EXPECT_GT(scale, 1e-6);
  EXPECT_LT(worst, 1e-4 * scale) << "gradients differ by " << worst << " of " << scale;
  fs::remove_all(dumps);
}

TEST(Cluster, BadInputGetsExitCodesAndClearErrors) {
  Cluster c(1, 2);
  ASSERT_TRUE(c.up());
  auto [rc, out] = c.ctl({"job", "submit", "--experts", "8", "--top-k", "9", "--hidden", "8", "--ffn-hidden", "8",
                          "--tokens-per-rank", "4", "--steps", "1"});
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("top_k"), std::string::npos) << out;
  std::tie(rc, out) = c.ctl({"job", "submit", "--experts", "5", "--top-k", "1", "--hidden", "8", "--ffn-hidden", "8",
                             "--tokens-per-rank", "4", "--steps", "1"});
  EXPECT_EQ(rc, 2);  // 5 experts over 2 ranks: the agent's check
  EXPECT_NE(out.find("experts"), std::string::npos) << out;
  std::tie(rc, out) = c.ctl({"job", "submit", "--experts", "4", "--top-k", "1", "--hidden", "8", "--ffn-hidden", "8",
                             "--tokens-per-rank", "4", "--steps", "1", "--score", "tanh"});
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("score"), std::string::npos) << out;
  std::tie(rc, out) = c.ctl({"job", "status", "job-404"});
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("job-404"), std::string::npos) << out;
  std::tie(rc, out) = c.ctl({"job", "frobnicate"});
  EXPECT_EQ(rc, 2);

  // Frames the agent and a daemon must survive.
  const std::string agent = c.agent();
  v1::Envelope req;
  req.mutable_daemon_status();
  v1::Envelope status;
  status.mutable_cluster_status();
  const v1::ClusterStatus st = c.client().call(status, 10s).cluster_status_reply();
  ASSERT_EQ(st.nodes_size(), 1);
  for (const std::string& address : {agent, st.nodes(0).control_address()}) {
    const auto [host, port] = rpc::split_address(address);
    auto raw = [&](const std::string& bytes) { return exchange(host, port, bytes); };
    v1::Envelope hello;
    hello.mutable_hello()->set_token("not-the-token");
    for (const std::string& frame : {rpc::encode_frame(hello),                                 // unauthenticated
                                     std::string("\x7f\xff\xff\xff", 4),                        // oversized
                                     std::string("\x00\x00\x00\x03", 4) + "\xff\xff\xff"}) {  // malformed
      const std::string reply = raw(frame);
      ASSERT_GE(reply.size(), 4u) << address;
      const v1::Envelope e = rpc::decode_body(reinterpret_cast<const uint8_t*>(reply.data()) + 4, reply.size() - 4);
      EXPECT_TRUE(e.has_error()) << address;
    }
  }
  // Both still serve.
  EXPECT_EQ(c.client().call(status, 10s).cluster_status_reply().nodes_size(), 1);
  rpc::RpcClient daemon = c.client_of(st.nodes(0).control_address());
  EXPECT_EQ(daemon.call(req, 10s).daemon_status_reply().name(), "node0");

  // A stopped agent: exit 3, refused at once rather than waited for.
  c.ctl({"cluster", "down"});
  std::vector<std::string> args = {"--agent", agent, "cluster", "status"};
  std::tie(rc, out) = c.ctl(args, 30s);
  EXPECT_EQ(rc, 3) << out;
  EXPECT_NE(out.find("cannot reach " + agent), std::string::npos) << out;
  EXPECT_EQ(out.find("no reply"), std::string::npos) << "a deadline, not a refusal: " << out;
}

TEST(Cluster, KilledDaemonFailsTheJobNamingItAndARestartRejoins) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const std::string id = c.start_long_job(3);
  const pid_t victim = std::stoi(read_text_file(c.dir() / "pids" / "node1.pid"));
  ::kill(victim, SIGKILL);
  auto [rc, out] = c.ctl({"job", "wait", id}, 30s);  // rc -1: it hung (UCX's own endpoint timeout is 45 s)
  EXPECT_EQ(rc, 1) << out << c.logs();
  EXPECT_NE(out.find("FAILED"), std::string::npos) << out;
  EXPECT_NE(out.find("node1"), std::string::npos) << out << c.logs();

  // The agent keeps serving; a restarted node1 rejoins and runs the next job.
  std::tie(rc, out) = c.ctl({"cluster", "status"});
  EXPECT_EQ(rc, 0) << out;
  std::vector<std::string> argv = {kMoed, "--agent", c.agent(), "--devices", "1", "--token-file",
                                   (c.dir() / "token").string(), "--name", "node1", "--listen", "127.0.0.1:0"};
  for (const std::string& f : c.moed_tls_flags()) argv.push_back(f);
  Process restarted = Process::spawn(argv);
  const auto rejoin_until = std::chrono::steady_clock::now() + 30s;
  for (;;) {
    v1::Envelope req;
    req.mutable_cluster_status();
    const auto st = c.client().call(req, 10s).cluster_status_reply();
    if (st.nodes_size() == 2 && st.nodes(1).state() == v1::NODE_STATE_ALIVE) break;
    ASSERT_LT(std::chrono::steady_clock::now(), rejoin_until) << "node1 did not rejoin\n" << restarted.output();
    std::this_thread::sleep_for(20ms);  // polling for the registration
  }
  std::tie(rc, out) = c.ctl({"job", "submit", "--wait", "--experts", "4", "--top-k", "2", "--hidden", "32",
                             "--ffn-hidden", "16", "--tokens-per-rank", "32", "--steps", "2", "--verify"},
                            120s);
  EXPECT_EQ(rc, 0) << out << restarted.output() << c.logs();
  EXPECT_NE(out.find("SUCCEEDED"), std::string::npos) << out;
  restarted.kill(SIGTERM);
  EXPECT_EQ(restarted.wait(30s), 0) << restarted.output();
}

// A daemon SIGKILLed and restarted under the same name before its heartbeats
// run out used to hide its death: the job hung until UCX's endpoint timeout
// (44-46 s) and the next job waited as long. Its new registration now ends the
// old process's part at once: the job fails naming the restart, the survivors
// abort their waits, and the next job runs on the restarted node.
TEST(Cluster, ADaemonRestartedMidJobFailsTheJobAtOnceAndTheNextJobRuns) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up());
  const std::string id = c.start_long_job(3);
  ::kill(std::stoi(read_text_file(c.dir() / "pids" / "node1.pid")), SIGKILL);
  const auto [rrc, rout] = c.ctl({"node", "restart", "node1"}, 60s);  // within the 3 s heartbeat timeout
  ASSERT_EQ(rrc, 0) << rout << c.logs();
  // rc -1: still hanging after 15 s (it took 44 s before).
  auto [rc, out] = c.ctl({"job", "wait", id}, 15s);
  EXPECT_EQ(rc, 1) << out << c.logs();
  // Whichever comes first names node1: its new registration ("restarted during
  // the job") or a survivor's transport error blaming one of its ranks.
  EXPECT_NE(out.find("node node1"), std::string::npos) << out;
  std::tie(rc, out) = c.ctl({"job", "submit", "--wait", "--experts", "4", "--top-k", "2", "--hidden", "32",
                             "--ffn-hidden", "16", "--tokens-per-rank", "32", "--steps", "2"},
                            15s);
  EXPECT_EQ(rc, 0) << out << c.logs();
}

// docs/placement.md#node-redundancy: --min-node-replicas 2 puts a copy of every
// expert on each of the two nodes (no node's death loses an expert); the train
// job computes what the plain one does (replicas are exact copies; sums over
// them change the order of additions only), and verify passes.
TEST(Cluster, NodeRedundancyKeepsEveryExpertOnTwoNodesAndTheLossCurve) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up());
  const std::vector<std::string> job = {"--output", "json", "job", "submit", "--wait", "--mode", "train",
                                        "--experts", "16", "--top-k", "4", "--hidden", "32", "--ffn-hidden", "16",
                                        "--tokens-per-rank", "64", "--steps", "10", "--skew", "zipf:1.2"};
  auto [rc, out] = c.ctl(job, 120s);
  ASSERT_EQ(rc, 0) << out << c.logs();
  const v1::JobResult plain = parse_result(out);
  std::vector<std::string> redundant = job;
  redundant.insert(redundant.end(), {"--min-node-replicas", "2", "--verify"});
  std::tie(rc, out) = c.ctl(redundant, 120s);
  ASSERT_EQ(rc, 0) << out << c.logs();
  const v1::JobResult r = parse_result(out);
  EXPECT_TRUE(r.verify().passed()) << out;
  ASSERT_EQ(r.loss_size(), plain.loss_size());
  for (int i = 0; i < r.loss_size(); ++i) EXPECT_NEAR(r.loss(i), plain.loss(i), 1e-6 * plain.loss(i)) << "step " << i;
  v1::Envelope req;
  req.mutable_placement();
  const v1::PlacementReply p = c.client().call(req, 10s).placement_reply();
  ASSERT_EQ(p.maps_size(), 1);
  EXPECT_EQ(p.maps(0).slots_per_rank(), 8);
  for (int e = 0; e < 16; ++e) {  // node 0 holds slots 0-15, node 1 slots 16-31
    bool on[2] = {false, false};
    for (int slot = 0; slot < 32; ++slot)
      if (p.maps(0).phy2log(slot) == e) on[slot / 16] = true;
    EXPECT_TRUE(on[0] && on[1]) << "expert " << e;
  }
  std::tie(rc, out) = c.ctl({"job", "submit", "--experts", "4", "--top-k", "2", "--hidden", "8", "--ffn-hidden", "8",
                             "--tokens-per-rank", "8", "--steps", "1", "--min-node-replicas", "3"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("min_node_replicas: the job asks for every expert on 3 nodes; the cluster has 2"),
            std::string::npos)
      << out;
}

// docs/layer.md#overlap: forward jobs with their dispatch/combine in 3 chunks give
// the serial job's output at step 0 (dumped) and verify against the fp64
// reference; a train job chunks its layers' forward and backward pairs (and its
// teacher's), and its loss curve, through 6 optimizer steps on chunked gradients,
// stays the serial one, bit for bit (docs/backends.md#row-invariant-gemm). Over UCX between two
// daemons.
TEST(Cluster, ChunkedDispatchGivesTheSerialOutputAndLoss) {
  const fs::path dumps = fs::temp_directory_path() / ("moe_overlap_" + std::to_string(::getpid()));
  fs::remove_all(dumps);
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const std::vector<std::string> shape = {"--experts", "16", "--top-k", "4", "--hidden", "64", "--ffn-hidden", "32",
                                          "--tokens-per-rank", "256", "--layers", "2", "--skew", "zipf:0.8"};
  std::vector<float> outs[2];
  for (int i = 0; i < 2; ++i) {
    const std::string chunks = i == 0 ? "1" : "3", dir = (dumps / chunks).string();
    std::vector<std::string> args = {"--output", "json", "job", "submit", "--wait", "--steps", "2", "--verify",
                                     "--overlap-chunks", chunks, "--dump-dir", dir};
    args.insert(args.end(), shape.begin(), shape.end());
    const auto [rc, out] = c.ctl(args, 120s);
    ASSERT_EQ(rc, 0) << out << c.logs();
    const v1::JobResult r = parse_result(out);
    EXPECT_TRUE(r.verify().passed()) << out;
    EXPECT_EQ(r.overlap_chunks(), i == 0 ? 1 : 3) << out;
    outs[i] = dumped_out(dir, 2, 256, 64);
  }
  ASSERT_EQ(outs[0].size(), outs[1].size());
  double scale = 0, worst = 0;
  for (size_t i = 0; i < outs[0].size(); ++i) {
    scale = std::max(scale, static_cast<double>(std::fabs(outs[0][i])));
    worst = std::max(worst, static_cast<double>(std::fabs(outs[0][i] - outs[1][i])));
  }
  EXPECT_GT(scale, 1e-3);
  EXPECT_EQ(worst, 0.0) << "chunked and serial outputs differ by " << worst;

  std::vector<v1::JobResult> train;
  for (const char* chunks : {"1", "2"}) {
    std::vector<std::string> args = {"--output", "json", "job", "submit", "--wait", "--mode", "train", "--steps", "6",
                                     "--overlap-chunks", chunks};
    args.insert(args.end(), shape.begin(), shape.end());
    const auto [rc, out] = c.ctl(args, 120s);
    ASSERT_EQ(rc, 0) << out << c.logs();
    train.push_back(parse_result(out));
  }
  EXPECT_EQ(train[1].overlap_chunks(), 2);
  ASSERT_EQ(train[0].loss_size(), train[1].loss_size());
  for (int i = 0; i < train[0].loss_size(); ++i) EXPECT_EQ(train[1].loss(i), train[0].loss(i)) << "step " << i;
  fs::remove_all(dumps);
}

// docs/layer.md#wire-formats through moectl: fp8 and bf16 wires pass verify (the
// reference runs the experts on what the wire delivers), forward and train; the
// dispatch bytes shrink by the rows' sizes; a bad wire is refused at submit.
TEST(Cluster, WireFormatsVerifyAndShrinkTheDispatch) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const std::vector<std::string> shape = {"--experts", "16", "--top-k", "4", "--hidden", "256", "--ffn-hidden", "64",
                                          "--tokens-per-rank", "128", "--skew", "zipf:0.8", "--verify"};
  std::map<std::string, v1::JobResult> runs;
  for (const auto& [name, wire] :
       std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"fp32", {"--steps", "1"}},
           {"fp8", {"--steps", "1", "--dispatch-wire", "fp8", "--combine-wire", "bf16"}},
           {"train-bf16", {"--mode", "train", "--steps", "3", "--dispatch-wire", "bf16", "--combine-wire", "bf16"}},
           {"train-fp8", {"--mode", "train", "--steps", "3", "--dispatch-wire", "fp8"}}}) {
    std::vector<std::string> args = {"--output", "json", "job", "submit", "--wait"};
    args.insert(args.end(), shape.begin(), shape.end());
    args.insert(args.end(), wire.begin(), wire.end());
    const auto [rc, out] = c.ctl(args, 120s);
    ASSERT_EQ(rc, 0) << name << ": " << out << c.logs();
    runs[name] = parse_result(out);
    EXPECT_TRUE(runs[name].verify().passed()) << name << ": " << out;
  }
  // fp8: H + 4 x 2 scales + 8K + 4 bytes a row against 4H + 8K + 4 (slots, weights, the source token).
  const double want = (256.0 + 8 + 32 + 4) / (4 * 256 + 32 + 4);
  EXPECT_NEAR(runs["fp8"].dispatch_bytes() / runs["fp32"].dispatch_bytes(), want, 1e-9);
  EXPECT_NEAR(runs["fp8"].combine_bytes() / runs["fp32"].combine_bytes(), 0.5, 1e-9);
  const auto [rc, out] = c.ctl({"job", "submit", "--experts", "4", "--top-k", "2", "--hidden", "8", "--ffn-hidden", "8",
                                "--tokens-per-rank", "8", "--steps", "1", "--combine-wire", "fp8"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("combine_wire: must be fp32 or bf16"), std::string::npos) << out;
}

// docs/jobs.md#dead-nodes: a SIGSTOPped daemon (alive, silent) is dead once the
// job's own --dead-node-timeout-ms passed (here 1 s, not the agent's 3 s), the
// survivors abort their waits and the job fails naming it; continued, the node
// finds the agent no longer knows it, registers again, and the next job runs on
// it (its ranks' part in the old job ended with the failure).
TEST(Cluster, ASilentNodeIsDeadAfterTheJobsTimeoutAndRejoinsWhenItWakes) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  auto [rc, out] = c.ctl({"job", "submit", "--experts", "4", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "16",
                          "--tokens-per-rank", "32", "--steps", "1000000", "--dead-node-timeout-ms", "1000"});
  ASSERT_EQ(rc, 0) << out;
  const std::string id = out.substr(0, out.find('\n'));
  ASSERT_TRUE(poll_until([&] { return c.job(id).progress().step() >= 2; }, 30s)) << c.logs();
  const pid_t node1 = std::stoi(read_text_file(c.dir() / "pids" / "node1.pid"));
  ::kill(node1, SIGSTOP);
  std::tie(rc, out) = c.ctl({"job", "wait", id}, 30s);
  ::kill(node1, SIGCONT);
  EXPECT_EQ(rc, 1) << out << c.logs();
  EXPECT_NE(out.find("node node1 (ranks 1-1) stopped responding"), std::string::npos) << out;
  // The silence the agent waited for: the job's timeout, not --heartbeat-timeout-ms (3000).
  const std::string agent_log = read_text_file(c.dir() / "logs" / "agent.log");
  const auto at = agent_log.find("missed heartbeats for ");
  ASSERT_NE(at, std::string::npos) << agent_log;
  EXPECT_LT(std::stoi(agent_log.substr(at + 22)), 3000) << agent_log.substr(at, 80);
  std::tie(rc, out) = c.ctl({"job", "submit", "--wait", "--experts", "4", "--top-k", "2", "--hidden", "32",
                             "--ffn-hidden", "16", "--tokens-per-rank", "32", "--steps", "2"},
                            60s);
  EXPECT_EQ(rc, 0) << out << c.logs();
  // Below 4 heartbeat intervals is refused, naming the floor.
  std::tie(rc, out) = c.ctl({"job", "submit", "--experts", "4", "--top-k", "2", "--hidden", "32", "--ffn-hidden",
                             "16", "--tokens-per-rank", "32", "--steps", "2", "--dead-node-timeout-ms", "500"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("dead_node_timeout_ms: at least 4 heartbeat intervals (1000 ms), got 500"), std::string::npos)
      << out;
}

// The daemon's log tells the truth: the next job replacing a finished one cancels
// nothing (it used to log "cancel requested (daemon stopping)" for the old one).
TEST(Cluster, ANewJobReplacesAFinishedOneWithoutCancellingAnything) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  for (int job = 0; job < 2; ++job) {
    const auto [rc, out] = c.ctl({"job", "submit", "--wait", "--experts", "4", "--top-k", "2", "--hidden", "32",
                                  "--ffn-hidden", "16", "--tokens-per-rank", "32", "--steps", "1"},
                                 60s);
    ASSERT_EQ(rc, 0) << out << c.logs();
  }
  const std::string log = read_text_file(c.dir() / "logs" / "node0.log");
  EXPECT_NE(log.find("starting job-2"), std::string::npos) << log;
  EXPECT_EQ(log.find("cancel requested"), std::string::npos) << log;
}

TEST(Cluster, ADaemonStoppedMidJobCancelsIt) {
  // SIGTERM: the daemon's ranks stop at a step boundary (so do everyone's); the job
  // is recorded CANCELLED with the reason, not SUCCEEDED with fewer steps.
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const std::string id = c.start_long_job(2);
  ::kill(std::stoi(read_text_file((c.dir() / "pids" / "node0.pid").string())), SIGTERM);
  auto [rc, out] = c.ctl({"job", "wait", id}, 60s);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("CANCELLED"), std::string::npos) << out;
  EXPECT_NE(out.find("daemon stopping"), std::string::npos) << out;
}

// docs/architecture.md#processes: a daemon stopped while its job waits on a silent
// peer (and on a silent agent, which would otherwise halt the world) does not wait
// out the 30 s transfer deadline: after its --stop-grace it aborts the job's
// transfers, says so, and exits.
TEST(Cluster, AStoppedDaemonWhosePeerIsSilentExitsAfterItsStopGrace) {
  Cluster c(2, 1, {"--stop-grace", "1"});
  ASSERT_TRUE(c.up());
  const std::string id = c.start_long_job(2);
  auto pid_of = [&](const std::string& name) { return std::stoi(read_text_file(c.dir() / "pids" / (name + ".pid"))); };
  const pid_t node0 = pid_of("node0"), node1 = pid_of("node1"), agent = pid_of("agent");
  ::kill(agent, SIGSTOP);
  ::kill(node1, SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  ::kill(node0, SIGTERM);
  const bool exited = poll_until([&] { return !process_alive(node0); }, 25s);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ::kill(node1, SIGCONT);
  ::kill(agent, SIGCONT);
  ASSERT_TRUE(exited) << c.logs();
  EXPECT_LT(seconds, 20.0) << c.logs();  // the heartbeat call, the grace and a second for reports
  const std::string log = read_text_file(c.dir() / "logs" / "node0.log");
  EXPECT_NE(log.find("the job reached no step boundary within 1000 ms; aborting its transfers"), std::string::npos)
      << log;
  EXPECT_NE(log.find("stopped"), std::string::npos) << log;
}

TEST(Cluster, CancelStopsARunningJob) {
  Cluster c(1, 2);
  ASSERT_TRUE(c.up());
  const std::string id = c.start_long_job(1);
  auto [rc, out] = c.ctl({"job", "cancel", id});
  EXPECT_EQ(rc, 0) << out;
  std::tie(rc, out) = c.ctl({"job", "wait", id}, 30s);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("CANCELLED"), std::string::npos) << out;
  // The cluster takes the next job.
  std::tie(rc, out) = c.ctl({"job", "submit", "--wait", "--experts", "4", "--top-k", "2", "--hidden", "32",
                             "--ffn-hidden", "16", "--tokens-per-rank", "16", "--steps", "1"},
                            60s);
  EXPECT_EQ(rc, 0) << out;
  std::tie(rc, out) = c.ctl({"--output", "json", "job", "list"});
  EXPECT_NE(out.find("\"state\": \"CANCELLED\""), std::string::npos) << out;
}

}  // namespace
}  // namespace moe::test
