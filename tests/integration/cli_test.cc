// Every moectl command as a new user meets it: on a fresh cluster before any job
// (empty answers are answers), then with a job, in table and JSON output, with
// the exit codes of docs/cli.md#exit-codes.
#include <gtest/gtest.h>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "local_cluster.h"
#include "process.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

// The output parses as one JSON object.
void expect_json(const std::string& out, const std::string& what) {
  google::protobuf::Struct s;
  EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(out, &s).ok()) << what << " printed:\n" << out;
}

bool has(const std::string& out, const std::string& part) { return out.find(part) != std::string::npos; }

const std::vector<std::vector<std::string>> kReadOnly = {{"cluster", "status"}, {"job", "list"}, {"placement", "show"}};

std::vector<std::string> with_output(const char* output, const std::vector<std::string>& cmd) {
  std::vector<std::string> a = {"--output", output};
  a.insert(a.end(), cmd.begin(), cmd.end());
  return a;
}

// The command exits 0 with table output, and with JSON output that parses.
void expect_ok_in_both_outputs(const Cluster& c, const std::vector<std::string>& cmd) {
  const auto [rc, out] = c.ctl(with_output("table", cmd));
  EXPECT_EQ(rc, 0) << cmd[0] << " " << cmd[1] << ": " << out;
  const auto [jrc, json] = c.ctl(with_output("json", cmd));
  EXPECT_EQ(jrc, 0) << cmd[0] << " " << cmd[1] << ": " << json;
  expect_json(json, cmd[0] + " " + cmd[1]);
}

TEST(Cli, EveryCommandOnAFreshClusterAndAfterAJob) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  // Before any job: every read-only command answers, in both outputs.
  for (const auto& cmd : kReadOnly) expect_ok_in_both_outputs(c, cmd);
  EXPECT_TRUE(has(c.ctl({"job", "list"}).second, "no jobs yet"));
  EXPECT_TRUE(has(c.ctl({"placement", "show"}).second, "no placement yet"));
  for (const std::string verb : {"status", "wait", "cancel"}) {
    const auto [rc, out] = c.ctl({"job", verb, "job-99"});
    EXPECT_EQ(rc, 2) << verb << ": " << out;
    EXPECT_TRUE(has(out, "no job 'job-99'")) << out;
  }
  // No checkpoint yet: an empty checkpoint_dir, and a folder that does not exist.
  for (const std::string& dir : {c.dir().string(), (c.dir() / "nowhere").string()}) {
    const auto [rc, out] = c.ctl({"checkpoint", "show", dir});
    EXPECT_EQ(rc, 2) << out;
    EXPECT_TRUE(has(out, dir)) << out;
  }
  // The live view, once, before any job (tests/integration/top_test.cc drives it in a terminal).
  expect_ok_in_both_outputs(c, {"top", "--once"});

  // A spec file that asks for verify, and a flag that turns it off (--flag=false).
  const fs::path spec = c.dir() / "spec.json";
  std::ofstream(spec) << R"({"experts": 4, "top_k": 2, "hidden": 16, "ffn_hidden": 8, "tokens_per_rank": 16,
                             "steps": 2, "verify": true})";
  const auto [src, submitted] = c.ctl({"--output", "json", "job", "submit", "-f", spec.string(), "--verify=false"});
  ASSERT_EQ(src, 0) << submitted;
  const v1::JobResult queued = parse_result(submitted);
  EXPECT_FALSE(queued.spec().verify()) << submitted;
  const auto [wrc, waited] = c.ctl({"--output", "json", "job", "wait", queued.job_id()});
  EXPECT_EQ(wrc, 0) << waited << c.logs();
  EXPECT_EQ(parse_result(waited).state(), v1::JOB_STATE_SUCCEEDED) << waited;
  EXPECT_FALSE(parse_result(waited).has_verify()) << waited;

  // With a job: every command again, table and JSON.
  std::vector<std::vector<std::string>> all = kReadOnly;
  for (const std::string verb : {"status", "wait"}) all.push_back({"job", verb, queued.job_id()});
  for (const auto& cmd : all) expect_ok_in_both_outputs(c, cmd);
  // A job that ended cannot be cancelled: said, exit 2 (mistakes_test has the wording).
  EXPECT_EQ(c.ctl({"job", "cancel", queued.job_id()}).first, 2);
  EXPECT_TRUE(has(c.ctl({"job", "list"}).second, queued.job_id()));
  EXPECT_TRUE(has(c.ctl({"placement", "show"}).second, "epoch 1"));

  // A second cluster in the same state directory is refused.
  EXPECT_EQ(c.ctl({"cluster", "up"}).first, 2);
}

// docs/metrics.md#service-discovery: every process's /metrics is in cluster status,
// and the agent keeps a Prometheus file_sd file with one target group per process.
TEST(Cli, ClusterStatusAndTheScrapeTargetsNameEveryMetricsEndpoint) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  const v1::ClusterStatus st = c.status();
  ASSERT_FALSE(st.agent_metrics_address().empty());
  // The agent refreshes its gauges once a second.
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (series_value(scrape(st.agent_metrics_address()), "moe_nodes{state=\"alive\"}") != 2 &&
         std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(100ms);  // polling the agent's /metrics
  EXPECT_EQ(series_value(scrape(st.agent_metrics_address()), "moe_nodes{state=\"alive\"}"), 2);
  const std::string targets = read_text_file(c.dir() / "prometheus" / "targets.json");
  EXPECT_TRUE(has(targets, "\"" + st.agent_metrics_address() + "\"], \"labels\": {\"role\": \"agent\"")) << targets;
  const std::string table = c.ctl({"cluster", "status"}).second;
  EXPECT_TRUE(has(table, st.agent_metrics_address())) << table;
  for (const v1::NodeInfo& n : st.nodes()) {
    EXPECT_NE(scrape(n.metrics_address()).find("moe_build_info{backend=\"cpu\""), std::string::npos) << n.name();
    EXPECT_TRUE(has(targets, "\"" + n.metrics_address() + "\"], \"labels\": {\"role\": \"moed\", \"node\": \"" +
                                 n.name() + "\"}"))
        << targets;
    EXPECT_TRUE(has(table, n.metrics_address())) << table;
    EXPECT_EQ(n.backend(), v1::BACKEND_CPU);
    // Registration names each rank's device: here the CPU model, shown in the table.
    ASSERT_EQ(n.device_names_size(), 1) << n.name();
    EXPECT_TRUE(has(table, "on 1x " + n.device_names(0))) << table;
  }
}

TEST(Cli, ABackendTheMachineCannotRunIsRefusedWithTheDaemonsReason) {
  if (fs::exists("/dev/nvidia0")) GTEST_SKIP() << "this machine has a GPU";
  Cluster c(1, 1, {"--backend", "cpu"});  // a state dir; the cluster is replaced below
  ASSERT_TRUE(c.up());
  c.ctl({"cluster", "down"});
  const auto [rc, out] = c.ctl({"cluster", "up", "--backend", "cuda"}, 30s);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_TRUE(has(out, "node0 (moed) exited with status 2: --backend cuda:")) << out;
}

TEST(Cli, BadFlagValuesNameTheField) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  const std::vector<std::string> base = {"job", "submit", "--experts", "4", "--top-k", "2", "--hidden", "8",
                                         "--ffn-hidden", "8", "--tokens-per-rank", "8", "--steps", "1"};
  for (const auto& [flag, field] : std::vector<std::pair<std::string, std::string>>{
           {"--verify=maybe", "verify: expects true or false"},
           {"--layers=two", "layers: expects an integer"},
           {"--dtype=fp16", "dtype: expects fp32 | bf16"},
           {"--lr=fast", "lr: expects a number"}}) {
    std::vector<std::string> args = base;
    args.push_back(flag);
    const auto [rc, out] = c.ctl(args);
    EXPECT_EQ(rc, 2) << flag << ": " << out;
    EXPECT_TRUE(has(out, field)) << out;
  }
}

}  // namespace
}  // namespace moe::test
