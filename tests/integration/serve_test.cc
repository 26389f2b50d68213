// The expert service (docs/serving.md) through real processes: a serving job on
// a local cluster, called by programs through the client library. Each call's
// output is the fp64 reference's for the job's weights; bad calls get an error
// naming the problem while another client is served; a cancel ends the job.
#include <gtest/gtest.h>

#include <cmath>
#include <thread>

#include "local_cluster.h"
#include "moe/client/session.h"
#include "moe/ep/reference.h"
#include "moe/layer_spec/job_layers.h"
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

client::Session session_of(const Cluster& c, const std::string& id, const std::string& name) {
  return client::Session({.agent = c.agent(), .token = c.token(), .tls = c.tls(), .job = id, .name = name});
}

// The fp64 reference's output of `layer` for x [T, H], and each token's routing
// margin (a near-tie may route otherwise in fp32: those rows are not compared).
ref::Forward reference(const v1::JobSpec& spec, int layer, const std::vector<float>& x) {
  const model::LayerWeights w =
      layer_spec::layer_weights(spec, layer, std::vector<bool>(spec.experts(), true));
  const std::vector<double> xd(x.begin(), x.end());
  return ref::forward(ep::reference_config(layer_spec::layer_config(spec)), ep::reference_weights(w), xd,
                      static_cast<int64_t>(x.size()) / spec.hidden());
}

// y against the reference, relative to the output's scale, as verify holds fp32 jobs (1e-4).
void expect_reference(const v1::JobSpec& spec, int layer, const std::vector<float>& x, const std::vector<float>& y) {
  const ref::Forward want = reference(spec, layer, x);
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
        client::Session s = session_of(c, id, "client" + std::to_string(k));
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

}  // namespace
}  // namespace moe::test
