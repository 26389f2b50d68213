// The expert service (docs/serving.md) through real processes: a serving job on
// a local cluster, called by programs through the client library. Each call's
// output is the fp64 reference's for the job's weights; bad calls get an error
// naming the problem while another client is served; a cancel ends the job.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <tuple>
#include <thread>

#include "local_cluster.h"
#include "moe/client/session.h"
#include "moe/ep/reference.h"
#include "moe/io/safetensors.h"
#include "moe/layer_spec/job_layers.h"
#include "moe/tensor_wire/tensor_port.h"
#include "test_util.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;

const std::vector<std::string> kServeSpec = {"--mode", "serve", "--experts", "8", "--top-k", "2", "--hidden", "32",
                                             "--ffn-hidden", "16", "--layers", "2", "--tokens-per-rank", "48",
                                             "--seed", "11", "--shared-experts", "1", "--shared-ffn-hidden", "8",
                                             "--serve-max-wait-ms", "1"};

// Submits the serving job and returns its id once it runs.
std::string start_serving(const Cluster& c) {
  const auto [rc, out] = c.ctl(concat({"job", "submit"}, kServeSpec));
  EXPECT_EQ(rc, 0) << out << c.logs();
  const std::string id = out.substr(0, out.find('\n'));
  EXPECT_TRUE(poll_until([&] { return c.job(id).state() == v1::JOB_STATE_RUNNING; }, 60s)) << c.logs();
  return id;
}

// wire_min_bytes 0: every call's rows on the tensor wire (docs/serving.md#data-path);
// the default: these small calls in the call.
client::Session session_of(const Cluster& c, const std::string& id, const std::string& name,
                           size_t wire_min_bytes = client::SessionOptions::kWireMinBytes) {
  return client::Session({.agent = c.agent(), .token = c.token(), .tls = c.tls(), .job = id, .name = name,
                          .wire_min_bytes = wire_min_bytes});
}

// The fp64 reference's output of `layer` for x [T, H], and each token's routing
// margin (a near-tie may route otherwise in fp32: those rows are not compared).
ref::Forward reference(const v1::JobSpec& spec, int layer, const std::vector<float>& x,
                       const model::LayerWeights* weights = nullptr) {
  const model::LayerWeights w =
      weights ? *weights : layer_spec::layer_weights(spec, layer, std::vector<bool>(spec.experts(), true));
  const std::vector<double> xd(x.begin(), x.end());
  return ref::forward(ep::reference_config(layer_spec::layer_config(spec)), ep::reference_weights(w), xd,
                      static_cast<int64_t>(x.size()) / spec.hidden());
}

// y against the reference, relative to the output's scale, as verify holds fp32 jobs (1e-4).
// weights: the job's (null: the spec's synthetic ones).
void expect_reference(const v1::JobSpec& spec, int layer, const std::vector<float>& x, const std::vector<float>& y,
                      const model::LayerWeights* weights = nullptr) {
  const ref::Forward want = reference(spec, layer, x, weights);
  ASSERT_EQ(y.size(), want.out.size());
  double scale = 0;
  for (double v : want.out) scale = std::max(scale, std::fabs(v));
  ASSERT_GT(scale, 0);
  const int H = spec.hidden();
  int compared = 0;
  for (size_t t = 0; t < want.selection_margin.size(); ++t) {
    if (want.selection_margin[t] <= 1e-5) continue;
    ++compared;
    for (int h = 0; h < H; ++h)
      ASSERT_LE(std::fabs(y[t * H + h] - want.out[t * H + h]), 1e-4 * scale) << "layer " << layer << " row " << t;
  }
  EXPECT_GT(compared, static_cast<int>(want.selection_margin.size()) / 2);
}

// What a bad call is told: the RpcError's message (empty when it succeeded).
template <typename F>
std::string error_of(F call) {
  try {
    call();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(Serve, OneByOneAnswersEveryLayerAsTheReferenceAndRefusesBadCallsNamingTheField) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up()) << c.logs();
  const std::string id = start_serving(c);
  client::Session s = session_of(c, id, "first");
  const v1::JobSpec& spec = s.spec();
  for (int layer = 0; layer < 2; ++layer)
    for (int64_t rows : {1, 17, 48}) {  // 48: a whole step of the rank
      const std::vector<float> x = normal_vector(rows * spec.hidden(), 100 + layer * 7 + rows);
      expect_reference(spec, layer, x, s.forward(layer, x));
    }

  client::Session other = session_of(c, id, "second");
  const std::vector<float> x = normal_vector(5 * spec.hidden(), 3);
  EXPECT_NE(error_of([&] { other.forward(2, x); }).find("layer: the job serves layers 0-1, got 2"), std::string::npos);
  {  // a caller other than the client library: x's bytes do not match its rows
    v1::Envelope raw;
    v1::ServeForward* f = raw.mutable_serve_forward();
    f->set_job_id(id);
    f->set_rows(10);
    f->set_hidden(spec.hidden());
    f->set_dtype(v1::JobSpec::fp32);
    f->set_x(std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
    rpc::RpcClient node = c.client_of(c.status().nodes(0).control_address());
    EXPECT_NE(error_of([&] { node.call(raw, 10s); }).find("x: 10 rows of 32 fp32 values are 1280 bytes, got 640"),
              std::string::npos);
  }
  std::vector<float> bad = x;
  bad[3 * spec.hidden() + 4] = std::nanf("");
  EXPECT_NE(error_of([&] { other.forward(0, bad); }).find("x: row(s) 3 hold a value that is not finite"),
            std::string::npos);
  EXPECT_NE(error_of([&] { other.forward_bytes(0, x.data(), 2, v1::JobSpec::bf16); }).find("dtype: the job computes in fp32"),
            std::string::npos);
  const std::vector<float> huge = normal_vector(49 * spec.hidden(), 4);
  EXPECT_NE(error_of([&] { other.forward(0, huge); }).find("rows: must be in [1, 48]"), std::string::npos);
  // A caller without the token, or without a certificate, is refused before it reaches the job.
  const std::string no_token = error_of([&] {
    client::Session({.agent = c.agent(), .token = "not-the-token", .tls = c.tls(), .job = id, .name = "stranger"});
  });
  EXPECT_NE(no_token.find("token"), std::string::npos) << no_token;
  const std::string no_cert =
      error_of([&] { client::Session({.agent = c.agent(), .token = c.token(), .tls = {}, .job = id, .name = "stranger"}); });
  EXPECT_NE(no_cert.find("TLS"), std::string::npos) << no_cert;
  {  // straight to a node, past the agent: the same
    rpc::RpcClient node(rpc::ClientOptions::make(c.status().nodes(0).control_address(), "not-the-token", "client",
                                                 "stranger", c.tls()));
    v1::Envelope call;
    call.mutable_serve_forward()->set_job_id(id);
    const std::string refused = error_of([&] { node.call(call, 10s); });
    EXPECT_NE(refused.find("token"), std::string::npos) << refused;
  }
  expect_reference(spec, 1, x, s.forward(1, x));  // the first client is served throughout

  const auto [rc, out] = c.ctl({"job", "cancel", id});
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(poll_until([&] { return c.job(id).state() == v1::JOB_STATE_CANCELLED; }, 30s)) << c.logs();
  EXPECT_NE(error_of([&] { s.forward(0, x); }).find("is not running"), std::string::npos);
}

TEST(Serve, TwoByTwoServesConcurrentClientsOverEveryRank) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up()) << c.logs();
  const std::string id = start_serving(c);
  std::vector<std::thread> clients;
  std::vector<std::string> failures(4);
  for (int k = 0; k < 4; ++k)
    clients.emplace_back([&, k] {
      try {
        client::Session s = session_of(c, id, "client" + std::to_string(k), k % 2 ? 0 : client::SessionOptions::kWireMinBytes);
        for (int call = 0; call < 6; ++call) {
          const int layer = (k + call) % 2;
          const std::vector<float> x = normal_vector((7 + 11 * k + call) * s.hidden(), 1000 * k + call);
          expect_reference(s.spec(), layer, x, s.forward(layer, x));
        }
      } catch (const std::exception& e) {
        failures[k] = e.what();
      }
    });
  for (auto& t : clients) t.join();
  for (int k = 0; k < 4; ++k) EXPECT_EQ(failures[k], "") << "client " << k << "\n" << c.logs();
  EXPECT_EQ(c.ctl({"job", "cancel", id}).first, 0);
  EXPECT_TRUE(poll_until([&] { return c.job(id).state() == v1::JOB_STATE_CANCELLED; }, 30s)) << c.logs();
}

// A client loop through a live rebalance (`placement rebalance`) on 2x2: no call
// fails, every output is the reference's (replicas compute the same bits, so
// the map in force does not change it), and the rebalance commits.
TEST(Serve, ALiveRebalanceDropsNoCall) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up()) << c.logs();
  const auto [rc, out] = c.ctl(concat({"job", "submit"}, concat(kServeSpec, {"--skew", "zipf:1.2"})));
  ASSERT_EQ(rc, 0) << out << c.logs();
  const std::string id = out.substr(0, out.find('\n'));
  ASSERT_TRUE(poll_until([&] { return c.job(id).state() == v1::JOB_STATE_RUNNING; }, 60s)) << c.logs();
  std::atomic<bool> stop{false};
  std::atomic<int> calls{0};
  std::string failure;
  std::thread client([&] {
    try {
      client::Session s = session_of(c, id, "loop");
      for (int call = 0; !stop || call < 1000; ++call) {
        const int layer = call % 2;
        const std::vector<float> x = normal_vector((1 + call % 23) * s.hidden(), 7000 + call);
        expect_reference(s.spec(), layer, x, s.forward(layer, x));
        ++calls;
      }
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  ASSERT_TRUE(poll_until([&] { return calls > 10 || !failure.empty(); }, 30s));
  // The calls' load reached the placement's window (a serving window is a second).
  ASSERT_TRUE(poll_until([&] { return c.job(id).progress().has_window_balancedness(); }, 30s)) << c.logs();
  const auto [src, status] = c.ctl({"job", "status", id});
  EXPECT_NE(status.find("clients          1"), std::string::npos) << status;
  EXPECT_NE(status.find("layer 0 forward"), std::string::npos) << status;
  EXPECT_NE(status.find(" ms, p99 "), std::string::npos) << status;
  const auto [rrc, rout] = c.ctl({"placement", "rebalance", "--redundant-experts", "4"}, 120s);
  stop = true;
  client.join();
  EXPECT_EQ(rrc, 0) << rout << c.logs();
  EXPECT_NE(rout.find("rebalance committed"), std::string::npos) << rout;
  // The real calls' skewed load moved the experts: layer 0's predicted balancedness is better.
  const size_t at = rout.find("layer 0: balancedness ");
  ASSERT_NE(at, std::string::npos) << rout;
  double before = 0, predicted = 0;
  ASSERT_EQ(std::sscanf(rout.c_str() + at, "layer 0: balancedness %lf -> predicted %lf", &before, &predicted), 2);
  EXPECT_GT(predicted, before + 0.2) << rout;
  EXPECT_EQ(failure, "") << c.logs();
  EXPECT_GE(calls.load(), 1000);
  // The nodes exported the calls they answered (docs/metrics.md#daemon-metrics).
  const auto cluster = c.status();
  std::string pages;
  for (const v1::NodeInfo& n : cluster.nodes()) {
    pages += scrape(n.metrics_address());
    EXPECT_NE(pages.find("moe_serve_queued_rows"), std::string::npos);
  }
  for (const char* layer : {"0", "1"}) {
    const std::string lane = std::string("kind=\"forward\",layer=\"") + layer + "\"";
    EXPECT_NE(pages.find("moe_serve_calls_total{" + lane + ",outcome=\"ok\"}"), std::string::npos) << pages;
    EXPECT_NE(pages.find("moe_serve_call_seconds_bucket{" + lane), std::string::npos);
    EXPECT_NE(pages.find("moe_serve_rows_total{" + lane + "}"), std::string::npos);
  }
  EXPECT_EQ(c.ctl({"job", "cancel", id}).first, 0);
}

// A client's loop of calls, each checked against the reference, on its own thread;
// the longest call is the largest stall a fault caused.
class CallLoop {
 public:
  // wire: the calls' rows on the tensor wire.
  CallLoop(const Cluster& c, const std::string& id, int calls, bool wire = false)
      : name_("loop-" + std::to_string(++loops_)), thread_([this, &c, id, calls, wire] { run(c, id, calls, wire); }) {}
  ~CallLoop() { join(); }
  void join() {
    if (thread_.joinable()) thread_.join();
  }
  int done() const { return done_; }
  double longest_seconds() const { return longest_; }
  const std::string& failure() const { return failure_; }

 private:
  void run(const Cluster& c, const std::string& id, int calls, bool wire) {
    try {
      client::Session s = session_of(c, id, name_, wire ? 0 : client::SessionOptions::kWireMinBytes);
      for (int call = 0; call < calls; ++call) {
        const int layer = call % 2;
        const std::vector<float> x = normal_vector((1 + call % 23) * s.hidden(), 9000 + call);
        const auto t0 = std::chrono::steady_clock::now();
        const std::vector<float> y = s.forward(layer, x);
        longest_ = std::max(longest_.load(), std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        expect_reference(s.spec(), layer, x, y);
        ++done_;
      }
    } catch (const std::exception& e) {
      failure_ = e.what();
    }
  }
  static inline std::atomic<int> loops_{0};
  const std::string name_;
  std::atomic<int> done_{0};
  std::atomic<double> longest_{0};
  std::string failure_;
  std::thread thread_;
};

// docs/serving.md#elastic-serving: node1 SIGKILLed while a client calls, then
// restarted. The job goes on on node0 and grows back; every one of the 1000
// calls is answered as the reference does (those in flight on node1 or in the
// failed world are computed again), the longest call shows the stall.
TEST(Serve, AnElasticServingJobLosesANodeGrowsBackAndDropsNoCall) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up()) << c.logs();
  const std::vector<std::string> elastic = {"--elastic", "--min-node-replicas", "2", "--dead-node-timeout-ms", "1000"};
  const auto [trc, train] = c.ctl(concat({"job", "submit"}, concat(kServeSpec, concat(elastic, {"--serve-train"}))));
  EXPECT_NE(trc, 0);
  EXPECT_NE(train.find("elastic: not for a serving job that trains"), std::string::npos) << train;
  const auto [rc, out] = c.ctl(concat({"job", "submit"}, concat(kServeSpec, elastic)));
  ASSERT_EQ(rc, 0) << out << c.logs();
  const std::string id = out.substr(0, out.find('\n'));
  ASSERT_TRUE(poll_until([&] { return c.job(id).state() == v1::JOB_STATE_RUNNING; }, 60s)) << c.logs();
  // Two callers, calls in flight on both nodes; the other's rows on the tensor wire.
  CallLoop loop(c, id, 1000), other(c, id, 1000, /*wire=*/true);
  ASSERT_TRUE(poll_until([&] { return loop.done() >= 200 || !loop.failure().empty(); }, 60s));
  ASSERT_EQ(::kill(c.pid_of("node1"), SIGKILL), 0);
  ASSERT_TRUE(poll_until([&] { return c.job(id).world_changes_size() >= 1; }, 30s)) << c.logs();
  const int at_loss = loop.done();
  ASSERT_TRUE(poll_until([&] { return loop.done() >= at_loss + 200 || !loop.failure().empty(); }, 60s));
  const auto [restart_rc, restarted] = c.ctl({"node", "restart", "node1"}, 60s);
  ASSERT_EQ(restart_rc, 0) << restarted;
  ASSERT_TRUE(poll_until([&] { return c.job(id).world_changes_size() >= 2; }, 30s)) << c.logs();
  for (CallLoop* l : {&loop, &other}) {
    l->join();
    EXPECT_EQ(l->failure(), "") << c.logs();
    EXPECT_EQ(l->done(), 1000);
  }
  const v1::JobResult r = c.job(id);
  EXPECT_EQ(r.state(), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(r.world_changes_size(), 2);
  EXPECT_EQ(r.world_changes(0).new_world(), 2);
  EXPECT_EQ(r.world_changes(1).kind(), "node_joined");
  EXPECT_EQ(r.world_changes(1).new_world(), 4);
  EXPECT_GT(r.world_changes(0).recovery_seconds(), 0.0);  // the new world's first step reported
  // The reporting windows go on in the grown world: job status keeps counting.
  const double windows = r.steps_completed();
  EXPECT_TRUE(poll_until([&] { return c.job(id).steps_completed() >= windows + 2; }, 10s)) << c.logs();
  // A figure, not asserted (docs/serving.md#elastic-serving).
  std::printf("elastic serving: 2 x 1000 calls, 0 failed, longest call %.3f s, detection %.3f s, recovery %.3f s\n",
              std::max(loop.longest_seconds(), other.longest_seconds()), r.world_changes(0).detection_seconds(),
              r.world_changes(0).recovery_seconds());
  EXPECT_EQ(c.ctl({"job", "cancel", id}).first, 0);
  EXPECT_TRUE(poll_until([&] { return c.job(id).state() == v1::JOB_STATE_CANCELLED; }, 30s)) << c.logs();
}

// A raw caller of node 0 whose connections say they are one client's session.
rpc::RpcClient caller_of(const Cluster& c, const std::string& session) {
  rpc::ClientOptions o = rpc::ClientOptions::make(c.status().nodes(0).control_address(), c.token(), "client",
                                                  "raw-" + session, c.tls());
  o.session = session;
  return rpc::RpcClient(o);
}

v1::Envelope forward_of(const std::string& id, const v1::JobSpec& spec, const std::vector<float>& x, bool keep) {
  v1::Envelope e;
  v1::ServeForward* f = e.mutable_serve_forward();
  f->set_job_id(id);
  f->set_rows(static_cast<int64_t>(x.size()) / spec.hidden());
  f->set_hidden(spec.hidden());
  f->set_dtype(v1::JobSpec::fp32);
  f->set_x(std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
  f->set_keep_for_backward(keep);
  return e;
}

v1::Envelope backward_of(const std::string& id, const v1::JobSpec& spec, uint64_t handle, const std::vector<float>& g) {
  v1::Envelope e;
  v1::ServeBackward* b = e.mutable_serve_backward();
  b->set_job_id(id);
  b->set_handle(handle);
  b->set_rows(static_cast<int64_t>(g.size()) / spec.hidden());
  b->set_hidden(spec.hidden());
  b->set_dtype(v1::JobSpec::fp32);
  b->set_grad_y(std::string(reinterpret_cast<const char*>(g.data()), g.size() * 4));
  return e;
}

// docs/serving.md#data-path: calls whose rows travel on the tensor wire are
// answered as the reference does; a stranger who reaches the node's UCX worker
// but lacks the session's key cannot feed a call, and a call naming a wire that
// is not its session's, or rows that never come, is refused by name.
TEST(Serve, TheTensorWireCarriesCallsSealedAndAStrangerCannotFeedThem) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up()) << c.logs();
  const std::string id = start_serving(c);
  client::Session s = session_of(c, id, "wired", 0);
  const v1::JobSpec& spec = s.spec();
  for (int layer = 0; layer < 2; ++layer)
    for (int64_t rows : {1, 17, 48}) {
      const std::vector<float> x = normal_vector(rows * spec.hidden(), 200 + layer * 7 + rows);
      expect_reference(spec, layer, x, s.forward(layer, x));
    }
  // A raw caller opens its own wire: it learns the node's UCX address, as anyone
  // who reaches the network could.
  rpc::ClientOptions o = rpc::ClientOptions::make(c.status().nodes(0).control_address(), c.token(), "client", "raw",
                                                  c.tls());
  o.session = "raw-session";
  rpc::RpcClient raw(o);
  tensor_wire::TensorPort stranger{tensor_wire::PortOptions{tensor_wire::Direction::kToClient}};
  v1::Envelope open;
  open.mutable_serve_open_wire()->set_job_id(id);
  open.mutable_serve_open_wire()->set_client_address(stranger.address());
  open.mutable_serve_open_wire()->set_client_peer(1);
  const v1::ServeOpenWireReply opened = raw.call(open, 10s).serve_open_wire_reply();
  ASSERT_EQ(opened.key().size(), 32u);
  ASSERT_NE(opened.node_peer(), 0u);
  // Forged rows under every tag the first session may use next, sealed with a key of the stranger's.
  const uint32_t to_node = stranger.add_peer(opened.node_address(), tensor_wire::new_key(), 1 << 20, 1 << 20);
  const std::vector<float> junk(48 * spec.hidden(), 1e30f);
  for (uint32_t peer = 1; peer < opened.node_peer(); ++peer)
    for (uint32_t seq = 1; seq <= 16; ++seq)
      stranger.send(to_node, tensor_wire::make_tag(tensor_wire::Direction::kToNode, peer, 6 + seq), junk.data(),
                    17 * spec.hidden() * 4, [](const std::string&) {});
  for (int call = 0; call < 8; ++call) {
    const std::vector<float> x = normal_vector(17 * spec.hidden(), 300 + call);
    expect_reference(spec, call % 2, x, s.forward(call % 2, x));
  }
  // A call naming the first session's wire peer from another session, and one whose rows never come.
  const std::vector<float> x = normal_vector(4 * spec.hidden(), 5);
  v1::Envelope call = forward_of(id, spec, x, false);
  call.mutable_serve_forward()->clear_x();
  call.mutable_serve_forward()->set_wire_peer(1);
  call.mutable_serve_forward()->set_wire_seq(1);
  const std::string not_ours = error_of([&] { raw.call(call, 10s); });
  EXPECT_EQ(not_ours.rfind("no tensor wire 1 of this session", 0), 0u) << not_ours;
  call.mutable_serve_forward()->set_wire_peer(opened.node_peer());
  const std::string never = error_of([&] { raw.call(call, 2s); });
  EXPECT_NE(never.find("did not arrive on the tensor wire in time"), std::string::npos) << never;
  expect_reference(spec, 0, x, s.forward(0, x));
}

// docs/example-lm.md#routing-traces: a serving job records its calls' routing
// (the first trace_tokens forward rows of each layer) and rows; the file holds
// the rows the calls sent and the fp64 reference's selection and weights of them.
TEST(Serve, AServingJobRecordsItsCallsRoutingAndRows) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up()) << c.logs();
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("moe_trace_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const auto [frc, refused] = c.ctl({"job", "submit", "--experts", "8", "--top-k", "2", "--hidden", "32",
                                     "--ffn-hidden", "16", "--tokens-per-rank", "8", "--steps", "1", "--trace-dir",
                                     dir.string()});
  EXPECT_NE(frc, 0);
  EXPECT_NE(refused.find("trace_dir: records a serving job's calls"), std::string::npos) << refused;
  const auto [rc, out] = c.ctl(concat({"job", "submit"}, concat(kServeSpec, {"--trace-dir", dir.string(),
                                                                             "--trace-tokens", "40", "--trace-hidden"})));
  ASSERT_EQ(rc, 0) << out << c.logs();
  const std::string id = out.substr(0, out.find('\n'));
  ASSERT_TRUE(poll_until([&] { return c.job(id).state() == v1::JOB_STATE_RUNNING; }, 60s)) << c.logs();
  client::Session s = session_of(c, id, "traced");
  const v1::JobSpec spec = s.spec();
  const int H = spec.hidden();
  std::vector<float> sent;  // layer 0's rows in call order: 3 x 17, of which the first 40 are kept
  for (int call = 0; call < 3; ++call) {
    const std::vector<float> x = normal_vector(17 * H, 700 + call);
    s.forward(0, x);
    sent.insert(sent.end(), x.begin(), x.end());
  }
  s.forward(1, normal_vector(5 * H, 800));
  EXPECT_EQ(c.ctl({"job", "cancel", id}).first, 0);
  ASSERT_TRUE(poll_until([&] { return c.job(id).state() == v1::JOB_STATE_CANCELLED; }, 30s)) << c.logs();

  io::SafetensorsReader trace((dir / "routing-rank0.safetensors").string());
  EXPECT_EQ(trace.metadata().at("experts"), "8");
  EXPECT_EQ(trace.metadata().at("top_k"), "2");
  EXPECT_EQ(trace.metadata().at("job"), id);
  const std::vector<float> rows = trace.read_f32("layer0.hidden", {40, H});
  EXPECT_EQ(rows, std::vector<float>(sent.begin(), sent.begin() + 40 * H));
  const std::vector<int32_t> ids = trace.read_i32("layer0.topk_ids", {40, 2});
  const std::vector<float> weights = trace.read_f32("layer0.topk_weights", {40, 2});
  const ref::Forward want = reference(spec, 0, rows);
  int compared = 0;
  for (int t = 0; t < 40; ++t) {
    if (want.selection_margin[t] <= 1e-5) continue;
    ++compared;
    for (int k = 0; k < 2; ++k) {
      EXPECT_EQ(ids[t * 2 + k], want.topk_idx[t * 2 + k]) << "row " << t;
      EXPECT_NEAR(weights[t * 2 + k], want.topk_weight[t * 2 + k], 1e-5) << "row " << t;
    }
  }
  EXPECT_GT(compared, 20);
  EXPECT_EQ(trace.info("layer1.topk_ids").shape, (std::vector<int64_t>{5, 2}));
  // moe-placement-sim evaluates placements on it.
  const std::string sim = std::string(MOE_BIN_DIR) + "/agent/placement/moe-placement-sim --trace " +
                          (dir / "routing-rank0.safetensors").string() + " --ranks 2 --nodes 1 --redundant-experts 2";
  FILE* p = ::popen(sim.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string report;
  char buf[512];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) report.append(buf, n);
  EXPECT_EQ(::pclose(p), 0) << report;
  EXPECT_NE(report.find("recorded trace: 1 file(s), 2 layer(s), top-2, tokens per layer: 40 5"), std::string::npos)
      << report;

  // Jobs on the recorded rows (--inputs): a forward job's step-0 tokens are the
  // trace's first rows (its dump shows them); a train job keeps its teacher.
  const std::string file = (dir / "routing-rank0.safetensors").string();
  const std::vector<std::string> shape = {"--experts", "8", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "16",
                                          "--tokens-per-rank", "16", "--steps", "3", "--inputs", file};
  const auto [src, sout] = c.ctl(concat({"job", "submit", "--wait", "--dump-dir", (dir / "dump").string()}, shape), 60s);
  ASSERT_EQ(src, 0) << sout << c.logs();
  io::SafetensorsReader dump((dir / "dump" / "rank0.safetensors").string());
  EXPECT_EQ(dump.read_f32("x", {16, H}), std::vector<float>(rows.begin(), rows.begin() + 16 * H));
  const auto [trc, tout] = c.ctl(concat({"job", "submit", "--wait", "--mode", "train"}, shape), 60s);
  EXPECT_EQ(trc, 0) << tout << c.logs();
  const auto [brc, bout] =
      c.ctl(concat({"job", "submit", "--wait", "--inputs", (dir / "missing.safetensors").string()},
                   std::vector<std::string>(shape.begin(), shape.end() - 2)),
            60s);
  EXPECT_NE(brc, 0);
  EXPECT_NE(bout.find("missing.safetensors"), std::string::npos) << bout;
  std::filesystem::remove_all(dir);
}

// docs/serving.md#disconnects: a client that goes away loses what the node kept
// for it, at once, while another client is served.
TEST(Serve, AClientThatDisconnectsHasItsQueuedRowsAndHandlesFreed) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up()) << c.logs();
  // A call that comes while another caller is recent waits for that caller's
  // next call, here up to 10 s: long enough to go away from.
  std::vector<std::string> spec_args = concat(kServeSpec, {"--serve-train"});
  spec_args[std::find(spec_args.begin(), spec_args.end(), "--serve-max-wait-ms") - spec_args.begin() + 1] = "10000";
  const auto [rc, out] = c.ctl(concat({"job", "submit"}, spec_args));
  ASSERT_EQ(rc, 0) << out << c.logs();
  const std::string id = out.substr(0, out.find('\n'));
  ASSERT_TRUE(poll_until([&] { return c.job(id).state() == v1::JOB_STATE_RUNNING; }, 60s)) << c.logs();
  client::Session other = session_of(c, id, "other");
  const v1::JobSpec& spec = other.spec();
  const std::vector<float> x = normal_vector(4 * spec.hidden(), 21), g = normal_vector(4 * spec.hidden(), 22);
  // Each connection is a caller; one that called within 250 ms is waited for.
  const auto alone = [] { std::this_thread::sleep_for(300ms); };  // past ServeQueue::kRecentCaller

  // Handles: session s1 keeps one on two connections, s2 one on its own.
  uint64_t mine = 0, theirs = 0;
  rpc::RpcClient s2 = caller_of(c, "s2");
  {
    rpc::RpcClient first = caller_of(c, "s1"), second = caller_of(c, "s1");
    mine = first.call(forward_of(id, spec, x, true), 10s).serve_forward_reply().handle();
    alone();
    ASSERT_NE(second.call(forward_of(id, spec, x, false), 10s).serve_forward_reply().y(), "");
    alone();
    theirs = s2.call(forward_of(id, spec, x, true), 10s).serve_forward_reply().handle();
    ASSERT_NE(mine, 0u);
    ASSERT_NE(theirs, 0u);
  }  // s1's connections close
  ASSERT_TRUE(poll_until([&] { return c.logs().find("dropped 1 handle(s)") != std::string::npos; }, 10s)) << c.logs();
  rpc::RpcClient again = caller_of(c, "s1");
  EXPECT_NE(error_of([&] { again.call(backward_of(id, spec, mine, g), 10s); }).find("is spent or expired"),
            std::string::npos);
  alone();
  EXPECT_EQ(s2.call(backward_of(id, spec, theirs, g), 10s).serve_backward_reply().rows(), 4);
  alone();

  // Queued rows: a caller killed while its call waits; its rows leave the queue
  // and the call counts as failed at once, not at its 30 s deadline. The caller
  // is a process of its own, connected first; it calls right after `other`
  // did, so `other` is a recent caller the rank waits for.
  const rpc::ClientOptions doomed = rpc::ClientOptions::make(c.status().nodes(0).control_address(), c.token(),
                                                             "client", "doomed", c.tls());
  const v1::Envelope waiting_call = forward_of(id, spec, x, false);
  int ready[2], go[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(go), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // connects, says so, waits for the word, then one call that waits
    ::close(ready[0]);
    ::close(go[1]);
    try {
      rpc::RpcClient caller(doomed);
      v1::Envelope hello_status;
      hello_status.mutable_daemon_status();
      caller.call(hello_status, 30s);
      char b = 'r';
      if (::write(ready[1], &b, 1) == 1 && ::read(go[0], &b, 1) == 1) caller.call(waiting_call, 30s);
    } catch (...) {
    }
    ::_exit(0);
  }
  ::close(ready[1]);
  ::close(go[0]);
  char b = 0;
  ASSERT_EQ(::read(ready[0], &b, 1), 1) << "the caller could not connect";
  expect_reference(spec, 0, x, other.forward(0, x));  // `other` is a recent caller now
  ASSERT_EQ(::write(go[1], &b, 1), 1);
  const std::string metrics = c.status().nodes(0).metrics_address();
  const std::string queued = "moe_serve_calls_total{kind=\"forward\",layer=\"0\",outcome=\"failed\"}";
  std::this_thread::sleep_for(500ms);  // the call is queued: the rank waits for `other`, up to 10 s
  EXPECT_LE(series_value(scrape(metrics), queued), 0.0) << "the waiting call ended early";
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ::close(ready[0]);
  ::close(go[1]);
  EXPECT_TRUE(poll_until([&] { return series_value(scrape(metrics), queued) == 1; }, 5s)) << scrape(metrics);
  alone();
  expect_reference(spec, 0, x, other.forward(0, x));  // the other client is served on
  EXPECT_EQ(c.ctl({"job", "cancel", id}).first, 0);
}

// --- Training through the service (docs/serving.md#training) ---

// The largest |a - b| over the largest |b|.
double relative_error(const std::vector<float>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double err = 0, scale = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    err = std::max(err, std::fabs(a[i] - b[i]));
    scale = std::max(scale, std::fabs(b[i]));
  }
  return scale > 0 ? err / scale : err;
}

std::vector<float> floats(const std::string& bytes) {
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

std::vector<float> floats(const std::vector<uint8_t>& bytes) {
  return floats(std::string(bytes.begin(), bytes.end()));
}

// One layer's weights after one optimizer step on gradient g from w (the
// first step: Adam's moments start at zero, so its update is g / (|g| + eps)).
std::vector<double> stepped(const std::vector<float>& w, const std::vector<double>& g, bool adam, double lr) {
  std::vector<double> out(w.size());
  for (size_t i = 0; i < w.size(); ++i)
    out[i] = w[i] - lr * (adam ? g[i] / (std::fabs(g[i]) + 1e-8) : g[i]);
  return out;
}

// Summed reference gradients of the calls of one layer.
struct RefGrads {
  std::vector<double> gate, w13, w2, shared_w13, shared_w2;
  void add(const ref::Grads& g) {
    auto acc = [](std::vector<double>& sum, const std::vector<double>& v) {
      if (sum.empty()) sum.assign(v.size(), 0.0);
      for (size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
    };
    acc(gate, g.grad_gate);
    acc(w13, g.grad_w13);
    acc(w2, g.grad_w2);
    acc(shared_w13, g.grad_shared_w13);
    acc(shared_w2, g.grad_shared_w2);
  }
};

// On 2x2: forward calls kept for backward and their backward calls on both
// layers (outputs and input gradients against the fp64 reference), one
// optimizer step (the weights read back are the reference update of the summed
// gradients), and the training calls' bad inputs, each refused naming why.
// wire: forward and backward rows on the tensor wire.
void train_through_the_service(const std::string& optimizer, bool wire) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up()) << c.logs();
  const double lr = 0.05;
  const auto [rc, out] = c.ctl(concat({"job", "submit"}, concat(kServeSpec, {"--serve-train", "--optimizer", optimizer,
                                                                             "--lr", "0.05"})));
  ASSERT_EQ(rc, 0) << out << c.logs();
  const std::string id = out.substr(0, out.find('\n'));
  ASSERT_TRUE(poll_until([&] { return c.job(id).state() == v1::JOB_STATE_RUNNING; }, 60s)) << c.logs();
  client::Session s = session_of(c, id, "trainer", wire ? 0 : client::SessionOptions::kWireMinBytes);
  const v1::JobSpec& spec = s.spec();
  const int H = spec.hidden();
  EXPECT_NE(error_of([&] { s.step(); }).find("step 1: nothing to apply, no backward call since step 0"),
            std::string::npos);
  const v1::ServeWeightsReply before = s.weights();
  ASSERT_EQ(before.layers_size(), 2);
  EXPECT_EQ(before.step(), 0);
  std::vector<RefGrads> want(2);
  for (int layer = 0; layer < 2; ++layer)
    for (int64_t rows : {17, 30}) {
      const std::vector<float> x = normal_vector(rows * H, 500 + layer * 10 + rows);
      const std::vector<float> g = normal_vector(rows * H, 900 + layer * 10 + rows, 0.1);
      const client::Session::Kept kept = s.forward_kept(layer, x.data(), rows, v1::JobSpec::fp32);
      expect_reference(spec, layer, x, floats(kept.y));
      const std::vector<float> grad_x = floats(s.backward_bytes(kept.handle, g.data(), v1::JobSpec::fp32));
      const model::LayerWeights w = layer_spec::layer_weights(spec, layer, std::vector<bool>(spec.experts(), true));
      const ref::Config cfg = ep::reference_config(layer_spec::layer_config(spec));
      const std::vector<double> xd(x.begin(), x.end()), gd(g.begin(), g.end());
      const ref::Forward f = ref::forward(cfg, ep::reference_weights(w), xd, rows);
      const ref::Grads rg = ref::backward(cfg, ep::reference_weights(w), xd, f, gd);
      EXPECT_LE(relative_error(grad_x, rg.grad_x), 1e-4) << "layer " << layer << " rows " << rows;
      want[layer].add(rg);
      // The handle is spent: a second backward is refused, naming it.
      EXPECT_NE(error_of([&] { s.backward_bytes(kept.handle, g.data(), v1::JobSpec::fp32); }).find("is spent or expired"),
                std::string::npos);
    }
  {  // bad backward calls
    const std::vector<float> x = normal_vector(4 * H, 7);
    const client::Session::Kept kept = s.forward_kept(1, x.data(), 4, v1::JobSpec::fp32);
    client::Session::Handle wrong = kept.handle;
    wrong.id += 1000;
    EXPECT_NE(error_of([&] { s.backward_bytes(wrong, x.data(), v1::JobSpec::fp32); }).find("was never given by this node"),
              std::string::npos);
    std::vector<float> bad = x;
    bad[2 * H] = std::numeric_limits<float>::infinity();
    EXPECT_NE(error_of([&] { s.backward_bytes(kept.handle, bad.data(), v1::JobSpec::fp32); })
                  .find("grad_y: row(s) 2 hold a value that is not finite"),
              std::string::npos);
    client::Session::Handle other_layer = kept.handle;
    other_layer.layer = 0;
    EXPECT_NE(error_of([&] { s.backward_bytes(other_layer, x.data(), v1::JobSpec::fp32); })
                  .find("holds rows of layer 1, got 0"),
              std::string::npos);
    // Refused calls left the handle good; a zero gradient adds nothing.
    const std::vector<float> zero(4 * H, 0.0f);
    const std::vector<float> grad_x = floats(s.backward_bytes(kept.handle, zero.data(), v1::JobSpec::fp32));
    EXPECT_TRUE(std::all_of(grad_x.begin(), grad_x.end(), [](float v) { return v == 0.0f; }));
  }
  EXPECT_EQ(s.step(), 1);
  EXPECT_NE(error_of([&] { s.step(); }).find("step 2: nothing to apply"), std::string::npos);
  const v1::ServeWeightsReply after = s.weights();
  EXPECT_EQ(after.step(), 1);
  const bool adam = optimizer == "adam";
  for (int l = 0; l < 2; ++l) {
    const v1::ServeLayerWeights &w0 = before.layers(l), &w1 = after.layers(l);
    const std::tuple<const char*, const std::string&, const std::string&, const std::vector<double>&> tensors[] = {
        {"gate", w0.gate(), w1.gate(), want[l].gate},
        {"w13", w0.w13(), w1.w13(), want[l].w13},
        {"w2", w0.w2(), w1.w2(), want[l].w2},
        {"shared_w13", w0.shared_w13(), w1.shared_w13(), want[l].shared_w13},
        {"shared_w2", w0.shared_w2(), w1.shared_w2(), want[l].shared_w2}};
    for (const auto& [name, was, now, g] : tensors) {
      const std::vector<double> expected = stepped(floats(was), g, adam, lr);
      const std::vector<float> got = floats(now);
      ASSERT_EQ(got.size(), expected.size()) << name;
      // Adam moves each weight by about lr whatever its gradient's size (one
      // near zero may go either way): the moves, relative to lr.
      double worst = 0;
      for (size_t i = 0; i < got.size(); ++i)
        if (!adam || std::fabs(g[i]) > 1e-6) worst = std::max(worst, std::fabs(got[i] - expected[i]));
      EXPECT_LE(worst, (adam ? 1e-4 : 1e-3) * lr) << "layer " << l << " " << name;
      EXPECT_NE(was, now) << "layer " << l << " " << name << " did not move";
    }
  }
  EXPECT_EQ(c.ctl({"job", "cancel", id}).first, 0);
  EXPECT_TRUE(poll_until([&] { return c.job(id).state() == v1::JOB_STATE_CANCELLED; }, 30s)) << c.logs();
}

// One optimizer step of both layers from a client's forward and backward calls
// (inputs keyed by `seed`); returns the job's optimizer steps after it.
int64_t train_step(client::Session& s, int seed) {
  const int H = s.hidden();
  for (int layer = 0; layer < 2; ++layer) {
    const std::vector<float> x = normal_vector(20 * H, seed + layer), g = normal_vector(20 * H, seed + 50 + layer, 0.1);
    const client::Session::Kept kept = s.forward_kept(layer, x.data(), 20, v1::JobSpec::fp32);
    s.backward_bytes(kept.handle, g.data(), v1::JobSpec::fp32);
  }
  return s.step();
}

// Every weight of `got` within 1e-6 of `want`'s largest (both after the same steps).
void expect_same_weights(const v1::ServeWeightsReply& got, const v1::ServeWeightsReply& want) {
  ASSERT_EQ(got.layers_size(), want.layers_size());
  EXPECT_EQ(got.step(), want.step());
  for (int l = 0; l < want.layers_size(); ++l) {
    const auto& g = got.layers(l);
    const auto& w = want.layers(l);
    for (const auto& [name, a, b] : {std::tuple{"gate", g.gate(), w.gate()}, {"w13", g.w13(), w.w13()},
                                     {"w2", g.w2(), w.w2()}, {"shared_w13", g.shared_w13(), w.shared_w13()}}) {
      const std::vector<float> fa = floats(a), fb = floats(b);
      ASSERT_EQ(fa.size(), fb.size()) << name;
      double scale = 0, worst = 0;
      for (size_t i = 0; i < fb.size(); ++i) {
        scale = std::max(scale, std::fabs(static_cast<double>(fb[i])));
        worst = std::max(worst, std::fabs(static_cast<double>(fa[i]) - fb[i]));
      }
      EXPECT_LE(worst, 1e-6 * scale) << "layer " << l << " " << name;
    }
  }
}

// docs/serving.md#checkpoints: a training serving job checkpoints every
// checkpoint_every optimizer steps and when cancelled; a job resumed from one
// goes on as the first did (weights and Adam's state: the same step 3).
TEST(Serve, ATrainingServingJobCheckpointsAndResumesAsItWouldHaveGoneOn) {
  Cluster c(1, 2);
  ASSERT_TRUE(c.up()) << c.logs();
  const std::string dir = (c.dir() / "ckpt").string();
  const auto [frc, forward_only] = c.ctl(concat({"job", "submit"}, concat(kServeSpec, {"--checkpoint-dir", dir})));
  EXPECT_NE(frc, 0);
  EXPECT_NE(forward_only.find("checkpoint_dir: a serving job that does not train"), std::string::npos) << forward_only;
  const auto [rc, out] = c.ctl(concat({"job", "submit"}, concat(kServeSpec, {"--serve-train", "--optimizer", "adam", "--lr",
                                                                             "0.01", "--checkpoint-dir", dir,
                                                                             "--checkpoint-every", "2"})));
  ASSERT_EQ(rc, 0) << out << c.logs();
  const std::string first = out.substr(0, out.find('\n'));
  ASSERT_TRUE(poll_until([&] { return c.job(first).state() == v1::JOB_STATE_RUNNING; }, 60s)) << c.logs();
  v1::ServeWeightsReply after3;
  {
    client::Session s = session_of(c, first, "trainer");
    for (int step = 1; step <= 3; ++step) ASSERT_EQ(train_step(s, 100 * step), step);
    after3 = s.weights();
  }
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(dir) / "step-000002" / "checkpoint.json"));
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(dir) / "step-000001"));
  EXPECT_EQ(c.ctl({"job", "cancel", first}).first, 0);
  EXPECT_TRUE(poll_until([&] { return c.job(first).state() == v1::JOB_STATE_CANCELLED; }, 30s)) << c.logs();
  EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(dir) / "step-000003" / "checkpoint.json")) << c.logs();

  const auto [rrc, rout] = c.ctl({"job", "submit", "--resume", dir + "/step-000002"});
  ASSERT_EQ(rrc, 0) << rout << c.logs();
  const std::string second = rout.substr(0, rout.find('\n'));
  ASSERT_TRUE(poll_until([&] { return c.job(second).state() == v1::JOB_STATE_RUNNING; }, 60s)) << c.logs();
  client::Session s = session_of(c, second, "trainer");
  EXPECT_EQ(s.steps(), 2);
  EXPECT_EQ(train_step(s, 300), 3);
  expect_same_weights(s.weights(), after3);
  EXPECT_EQ(c.ctl({"job", "cancel", second}).first, 0);
  EXPECT_TRUE(poll_until([&] { return c.job(second).state() == v1::JOB_STATE_CANCELLED; }, 30s)) << c.logs();

  // A model a train job trained, served: its weights are the checkpoint's, not the spec's.
  const std::string trained = (c.dir() / "trained").string();
  std::vector<std::string> train_args = {"--mode", "train", "--steps", "3", "--checkpoint-dir", trained};
  for (size_t i = 2; i + 1 < kServeSpec.size(); i += 2)
    if (kServeSpec[i] != "--serve-max-wait-ms") train_args.insert(train_args.end(), {kServeSpec[i], kServeSpec[i + 1]});
  const auto [trc, tout] = c.ctl(concat({"job", "submit", "--wait"}, train_args), 120s);
  ASSERT_EQ(trc, 0) << tout << c.logs();
  const auto [src, sout] = c.ctl({"job", "submit", "--resume", trained, "--mode", "serve"});
  ASSERT_EQ(src, 0) << sout << c.logs();
  const std::string served = sout.substr(0, sout.find('\n'));
  ASSERT_TRUE(poll_until([&] { return c.job(served).state() == v1::JOB_STATE_RUNNING; }, 60s)) << c.logs();
  client::Session model = session_of(c, served, "user");
  EXPECT_EQ(model.steps(), 3);
  const std::vector<float> x = normal_vector(5 * model.hidden(), 77);
  const ref::Forward synthetic = reference(model.spec(), 0, x);
  const std::vector<float> y = model.forward(0, x);
  double moved = 0;
  for (size_t i = 0; i < y.size(); ++i) moved = std::max(moved, std::fabs(y[i] - synthetic.out[i]));
  EXPECT_GT(moved, 1e-6) << "the served layer computes with the spec's weights, not the trained ones";
  const v1::ServeWeightsReply served_weights = model.weights();  // and as the reference does with the trained ones
  const v1::ServeLayerWeights& got = served_weights.layers(0);
  model::LayerWeights w = layer_spec::layer_weights(model.spec(), 0, std::vector<bool>(model.spec().experts(), true));
  w.gate = floats(got.gate());
  w.w13 = floats(got.w13());
  w.w2 = floats(got.w2());
  w.shared_w13 = floats(got.shared_w13());
  w.shared_w2 = floats(got.shared_w2());
  expect_reference(model.spec(), 0, x, y, &w);
  EXPECT_EQ(c.ctl({"job", "cancel", served}).first, 0);
}

TEST(Serve, TwoByTwoTrainsWithSgdAsTheReference) { train_through_the_service("sgd", false); }
TEST(Serve, TwoByTwoTrainsWithAdamAsTheReferenceOnTheTensorWire) { train_through_the_service("adam", true); }

}  // namespace
}  // namespace moe::test
