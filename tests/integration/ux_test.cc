// moectl as a user of kubectl, Slurm or Ray meets it (docs/cli.md): live
// progress, honest results, one JSON, and no dead ends. Each test drives real
// processes through moectl, its tables, its JSON and its exit codes; the
// comments name the shortcoming each one guards against.
#include <gtest/gtest.h>
#include <signal.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include "local_cluster.h"
#include "moe/v1/live_load.pb.h"
#include "process.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using Args = std::vector<std::string>;

bool has(const std::string& out, const std::string& part) { return out.find(part) != std::string::npos; }

const Args& kTiny = kTinyJob;

// The submitted job's id from `job submit` (no --wait).
std::string submit(const Cluster& c, const Args& args) {
  const auto [rc, out] = c.ctl(concat({"job", "submit"}, args));
  EXPECT_EQ(rc, 0) << out;
  return out.substr(0, out.find('\n'));
}

std::string agent_metrics(const Cluster& c) { return scrape(c.status().agent_metrics_address()); }

// A safetensors file with kTiny's router and no experts: the agent's check at
// submit passes it (docs/jobs.md#weights), the ranks fail the job as they load.
std::string routers_only_weights(const fs::path& file) {
  const std::string header = R"({"gate.weight":{"dtype":"F32","shape":[4,16],"data_offsets":[0,256]}})";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  std::ofstream(file, std::ios::binary) << bytes << header << std::string(256, '\0');
  return file.string();
}

// Item 1: a running job reported zeros and no loss. Now its status, JSON, watch
// stream, top and the agent's gauges carry live progress.
TEST(Ux, ARunningJobShowsLiveProgressEverywhere) {
  Cluster c(1, 2);
  ASSERT_TRUE(c.up());
  const std::string id = submit(c, {"--mode", "train", "--experts", "8", "--top-k", "2", "--hidden", "32",
                                    "--ffn-hidden", "16", "--tokens-per-rank", "64", "--steps", "1000000",
                                    "--name", "live", "--label", "team=a"});
  ASSERT_TRUE(poll_until([&] { return c.job(id).progress().step() >= 3; }, 60s)) << c.logs();
  ASSERT_TRUE(poll_until([&] { return c.job(id).tokens_per_second() > 0; }, 10s)) << "the result fields stay 0";
  const v1::JobResult j = c.job(id);
  EXPECT_EQ(j.state(), v1::JOB_STATE_RUNNING);
  EXPECT_GT(j.progress().tokens_per_second(), 0);
  EXPECT_GT(j.progress().step_seconds(), 0);
  EXPECT_TRUE(j.progress().has_loss());
  EXPECT_TRUE(j.progress().has_eta_seconds());
  EXPECT_GE(j.progress().epoch(), 1);
  EXPECT_FALSE(j.loss().empty()) << "the JSON had loss: [] while it ran";
  const std::string table = c.ctl({"job", "status", id}).second;
  for (const char* row : {"name             live", "labels           team=a", "step ", "loss ", "tokens/s ",
                          "step time ", "eta ", "placement epoch ", "balancedness "})
    EXPECT_TRUE(has(table, row)) << row << " in\n" << table;
  EXPECT_FALSE(has(table, "tokens/s         0\n")) << table;
  // --watch: a line per step (two or more within a second here), each with the loss.
  Process watch = Process::spawn({MOE_BIN_DIR "/cli/moectl", "--state-dir", c.dir().string(), "job", "status", id, "-w"});
  std::this_thread::sleep_for(1500ms);  // let the stream run
  watch.kill(SIGTERM);
  watch.wait(5s);
  const auto stream = output_lines(watch.output());
  ASSERT_GE(stream.size(), 3u) << watch.output();
  EXPECT_TRUE(has(stream[1], id + " RUNNING step ")) << stream[1];
  EXPECT_TRUE(has(stream[1], "loss ")) << stream[1];
  // top and the agent's gauges.
  EXPECT_TRUE(has(c.ctl({"top", "--once"}).second, "loss ")) << c.ctl({"top", "--once"}).second;
  ASSERT_TRUE(poll_until([&] { return series_value(agent_metrics(c), "moe_job_step{job_id=\"" + id + "\",name=\"live\"}") > 0; }, 5s))
      << agent_metrics(c);
  EXPECT_GT(series_value(agent_metrics(c), "moe_job_tokens_per_second{job_id=\"" + id + "\",name=\"live\"}"), 0);
  EXPECT_TRUE(has(agent_metrics(c), "moe_job_loss{job_id=\"" + id + "\""));
  // Item 9: a live rebalance, then the result's epoch table and human units.
  const auto [rrc, rout] = c.ctl({"placement", "rebalance", "--redundant-experts", "2"}, 120s);
  ASSERT_EQ(rrc, 0) << rout << c.logs();
  const int64_t after = c.job(id).progress().step();
  ASSERT_TRUE(poll_until([&] { return c.job(id).progress().step() >= after + 3; }, 60s));
  ASSERT_EQ(c.ctl({"job", "cancel", id}).first, 0);
  const auto [wrc, result] = c.ctl({"job", "wait", id}, 60s);
  EXPECT_EQ(wrc, 1) << result;
  EXPECT_TRUE(has(result, "EPOCH  STEPS")) << result;
  EXPECT_TRUE(std::regex_search(result, std::regex("dispatch bytes +[0-9.]+ (kB|MB|GB) \\("))) << result;
  EXPECT_FALSE(has(result, "e+0")) << "a number in exponent notation:\n" << result;
  const std::string list = c.ctl({"job", "list"}).second;
  EXPECT_TRUE(std::regex_search(list, std::regex(id + " .* [0-9.]+[kM]? +cancelled"))) << list;
  EXPECT_FALSE(has(list, "e+0")) << "job list's tokens/s in exponent notation:\n" << list;
  // Between jobs the progress gauges are gone.
  ASSERT_TRUE(poll_until([&] { return !has(agent_metrics(c), "moe_job_step{"); }, 5s)) << agent_metrics(c);
}

// Item 2: job list sorted as text and padded by one long message.
TEST(Ux, JobListIsInSubmitOrderWithTimesAndFitsTheWidth) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  std::vector<std::string> ids;
  for (int i = 0; i < 11; ++i) ids.push_back(submit(c, concat(kTiny, {"--steps", "2"})));
  // One failed job with a long message: weights that do not exist.
  const std::string bad = submit(
      c, concat(kTiny, {"--steps", "2", "--weights", routers_only_weights(c.dir() / (std::string(150, 'w') + ".safetensors"))}));
  ASSERT_EQ(c.ctl({"job", "wait", bad}, 60s).first, 1);
  EXPECT_EQ(c.ctl({"job", "status", bad, "-w"}).first, 1) << "a watch ends as a wait does";
  EXPECT_EQ(c.ctl({"job", "status", bad}).first, 0) << "a look is not a wait";
  ::setenv("COLUMNS", "100", 1);
  const auto [rc, out] = c.ctl({"job", "list"});
  ::unsetenv("COLUMNS");
  ASSERT_EQ(rc, 0) << out;
  const auto rows = output_lines(out);
  ASSERT_EQ(rows.size(), 13u) << out;
  EXPECT_TRUE(has(rows[0], "SUBMITTED")) << rows[0];
  EXPECT_TRUE(has(rows[0], "DURATION")) << rows[0];
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(rows[i + 1].rfind(ids[i] + " ", 0), 0u) << out;
  for (const auto& r : rows) EXPECT_LE(r.size(), 100u) << r;
  EXPECT_TRUE(has(rows.back(), "...")) << rows.back();
  // --state: only those.
  const auto [src, failed] = c.ctl({"job", "list", "--state", "failed"});
  EXPECT_EQ(output_lines(failed).size(), 2u) << failed;
  EXPECT_EQ(c.ctl({"job", "list", "--state", "sleeping"}).first, 2);
}

// Item 3 (resume reads the checkpoint's spec) is checkpoint_test's; here the
// required fields say "required".
TEST(Ux, AMissingRequiredFieldSaysRequired) {
  const auto [rc, out] = moectl({"job", "submit", "--experts", "4", "--top-k", "2", "--hidden", "8", "--ffn-hidden", "8",
                                 "--tokens-per-rank", "8"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_TRUE(has(out, "steps: required (--steps)")) << out;
}

// Item 4: bad agent flags, and automatic rebalances that cannot run.
TEST(Ux, ClusterUpRefusesBadAgentFlagsAndFailedAutoRebalancesShow) {
  const fs::path state = fs::temp_directory_path() / ("moe_ux_flags_" + std::to_string(::getpid()));
  for (const Args& flag : {Args{"--load-window", "abc"}, Args{"--balancedness-threshold", "5"}}) {
    const auto [rc, out] = moectl(concat({"--state-dir", state.string(), "cluster", "up"}, flag));
    EXPECT_EQ(rc, 2) << out;
    EXPECT_TRUE(has(out, "moe-agent refused its flags: " + flag[0])) << out;
    EXPECT_FALSE(fs::exists(state / "agent_address")) << "started an agent anyway";
  }
  fs::remove_all(state);
  // 8 experts + 3 redundant do not divide over 2 ranks: every attempt fails.
  Cluster c(1, 2, {"--redundant-experts", "3", "--rebalance-every", "2"});
  ASSERT_TRUE(c.up());
  const std::string id = submit(c, concat({"--experts", "8", "--top-k", "2", "--hidden", "16", "--ffn-hidden", "8",
                                         "--tokens-per-rank", "64", "--skew", "zipf:1.5"},
                                        {"--steps", "6"}));
  ASSERT_EQ(c.ctl({"job", "wait", id}, 60s).first, 0);
  const std::string status = c.ctl({"job", "status", id}).second;
  EXPECT_TRUE(has(status, "rebalance        auto-rebalance at step ")) << status;
  EXPECT_TRUE(has(status, "must be divisible by the ranks")) << status;
  ASSERT_TRUE(poll_until([&] { return series_value(agent_metrics(c), "moe_rebalances_total{result=\"failed\"}") >= 1; }, 5s))
      << agent_metrics(c);
}

// Item 5: one JSON everywhere on the line: short enums, integers as numbers.
TEST(Ux, JsonAnywhereWithShortEnumsAndNumbers) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  const std::string id = submit(c, concat(kTiny, {"--steps", "2"}));
  ASSERT_EQ(c.ctl({"job", "wait", id}, 60s).first, 0);
  for (const Args& cmd : {Args{"job", "list", "--output", "json"}, Args{"job", "status", id, "-o", "json"},
                          Args{"-o", "json", "placement", "show"}, Args{"cluster", "status", "-o", "json"}}) {
    const auto [rc, out] = c.ctl(cmd);
    ASSERT_EQ(rc, 0) << out;
    EXPECT_EQ(out.front(), '{') << out;
    EXPECT_EQ(out.substr(out.size() - 2), "}\n") << "a trailing blank line:\n" << out;
    EXPECT_FALSE(has(out, "JOB_STATE_") || has(out, "NODE_STATE_") || has(out, "BACKEND_")) << out;
    EXPECT_FALSE(std::regex_search(out, std::regex("\": \"[0-9]+\""))) << "an integer as a string:\n" << out;
  }
  const std::string status = c.ctl({"job", "status", id, "-o", "json"}).second;
  EXPECT_TRUE(has(status, "\"state\": \"SUCCEEDED\"")) << status;
  EXPECT_TRUE(has(status, "\"tokens_per_rank\": 16")) << status;
  EXPECT_EQ(parse_result(status).state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_TRUE(has(c.ctl({"placement", "show", "-o", "json"}).second, "\"epoch\": 1")) << c.ctl({"placement", "show", "-o", "json"}).second;
}

// Item 6: Ctrl-C on --wait detached silently; job wait had no --timeout.
TEST(Ux, InterruptingAWaitSaysHowToReattachAndTimeoutsEnd) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  Process waiting = Process::spawn(concat({MOE_BIN_DIR "/cli/moectl", "--state-dir", c.dir().string(), "job", "submit", "--wait"},
                                        concat(kTiny, {"--steps", "1000000"})));
  ASSERT_TRUE(poll_until([&] { return has(waiting.output(), " submitted"); }, 30s)) << waiting.output();
  const std::string id = waiting.output().substr(0, waiting.output().find(' '));
  waiting.kill(SIGINT);
  EXPECT_EQ(waiting.wait(10s), 130) << waiting.output();
  EXPECT_TRUE(has(waiting.output(), id + " keeps running")) << waiting.output();
  EXPECT_TRUE(has(waiting.output(), "moectl job wait " + id)) << waiting.output();
  EXPECT_TRUE(has(waiting.output(), "moectl job cancel " + id)) << waiting.output();
  EXPECT_EQ(c.job(id).state(), v1::JOB_STATE_RUNNING);
  const auto [rc, out] = c.ctl({"job", "wait", id, "--timeout", "1"});
  EXPECT_EQ(rc, 4) << out;
  EXPECT_TRUE(has(out, "had not ended after --timeout 1 s")) << out;
  EXPECT_EQ(c.ctl({"job", "cancel", id}).first, 0);
}

// Item 7: placement series of an earlier shape stayed; an empty window read 0.
TEST(Ux, MetricsDescribeOnlyTheLastShape) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  ASSERT_EQ(c.ctl(concat(concat({"job", "submit", "--wait"}, kTiny), {"--steps", "2", "--layers", "2"}), 60s).first, 0);
  ASSERT_TRUE(poll_until([&] { return has(agent_metrics(c), "moe_placement_epoch{layer=\"1\"}"); }, 5s));
  ASSERT_EQ(c.ctl(concat(concat({"job", "submit", "--wait"}, kTiny), {"--steps", "2", "--experts", "8"}), 60s).first, 0);
  ASSERT_TRUE(poll_until([&] { return has(agent_metrics(c), "moe_placement_shape_info{shape=\"8x1@1x1\"} 1"); }, 5s))
      << agent_metrics(c);
  const std::string m = agent_metrics(c);
  EXPECT_FALSE(has(m, "layer=\"1\"")) << m;
  EXPECT_FALSE(has(m, "shape=\"4x2@1x1\"")) << m;
  EXPECT_GT(series_value(m, "moe_placement_balancedness{layer=\"0\"}"), 0) << m;
}

// Item 8: a dead node blocked the queue silently; no way to restart one node.
TEST(Ux, AQueuedJobNamesTheDeadNodeAndNodeRestartBringsItBack) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  ::kill(std::stoi(read_text_file(c.dir() / "pids" / "node1.pid")), SIGKILL);
  ASSERT_TRUE(poll_until([&] { return has(c.ctl({"cluster", "status"}).second, "DEAD"); }, 15s));
  const std::string st = c.ctl({"cluster", "status"}).second;
  EXPECT_TRUE(has(st, "world 2 ranks (1 alive)")) << st;
  EXPECT_TRUE(has(st, "dead since")) << st;
  EXPECT_TRUE(has(c.ctl({"top", "--once"}).second, "2 ranks (1 alive)"));
  const std::string id = submit(c, concat(kTiny, {"--steps", "2"}));
  const std::string queued = c.ctl({"job", "status", id}).second;
  EXPECT_TRUE(has(queued, "waiting for      node node1: dead since")) << queued;
  EXPECT_TRUE(has(queued, "moectl node restart node1")) << queued;
  EXPECT_TRUE(has(c.ctl({"job", "list"}).second, "waiting for node node1"));
  // A wait on it says once what it waits for, then waits (here: into its --timeout).
  const auto [wrc, wout] = c.ctl({"job", "wait", id, "--timeout", "1"});
  EXPECT_EQ(wrc, 4) << wout;
  EXPECT_TRUE(has(wout, id + " QUEUED: waiting for node node1: dead since")) << wout;
  const auto [rrc, rout] = c.ctl({"node", "restart", "node1"}, 90s);
  ASSERT_EQ(rrc, 0) << rout << c.logs();
  EXPECT_EQ(c.ctl({"job", "wait", id}, 60s).first, 0) << c.logs();
  EXPECT_TRUE(has(c.ctl({"logs", "node1", "--tail", "50"}).second, "registered as node 1"));
  EXPECT_EQ(c.ctl({"logs", "node7"}).first, 2);
  EXPECT_EQ(c.ctl({"node", "restart", "node7"}).first, 2);
  const auto [arc, aout] = c.ctl({"cluster", "restart-agent"}, 60s);
  ASSERT_EQ(arc, 0) << aout << c.logs();
  EXPECT_TRUE(has(c.ctl({"job", "list"}).second, id)) << "the restarted agent kept its history";
}

// Item 9 (the epoch table and units) is checked in the first test; a job that
// failed before its verify step said "verify FAILED (max abs 0 ...)".
TEST(Ux, VerifyThatNeverRanSaysSo) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  const auto [rc, out] = c.ctl(concat(concat({"job", "submit", "--wait", "--verify"}, kTiny),
                                    {"--steps", "2", "--weights", routers_only_weights(c.dir() / "routers.safetensors")}),
                               60s);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_TRUE(has(out, "verify           not run (the job ended before step 0 was checked)")) << out;
  EXPECT_FALSE(has(out, "FAILED (max abs 0")) << out;
}

// Item 10: the conventions.
TEST(Ux, VersionCompletionHealthAndFriendlyErrors) {
  for (const char* bin : {"/cli/moectl", "/daemon/moed", "/agent/moe-agent", "/daemon/bench/moe-bench",
                          "/agent/placement/moe-placement-sim"}) {
    Process p = Process::spawn({std::string(MOE_BIN_DIR) + bin, "--version"});
    EXPECT_EQ(p.wait(10s), 0) << bin << ": " << p.output();
    EXPECT_TRUE(has(p.output(), "(git ")) << p.output();
    EXPECT_TRUE(has(p.output(), " build, CUDA backend: ")) << p.output();
  }
  Process moed = Process::spawn({MOE_BIN_DIR "/daemon/moed", "--version"});
  moed.wait(10s);
  // Which code computes: the kernels' ISA, the row GEMM's kernel, the engines (docs/backends.md#isa).
  for (const char* part : {": ISA avx", "row-invariant GEMM avx", "weight gradients fp32=", "OpenBLAS core "})
    EXPECT_TRUE(has(moed.output(), part)) << part << " in " << moed.output();
  const auto [crc, completion] = moectl({"completion", "bash"});
  EXPECT_EQ(crc, 0);
  EXPECT_TRUE(has(completion, "[\"moectl job submit\"]=\"")) << completion;
  EXPECT_TRUE(has(completion, "--ffn-hidden")) << completion;
  EXPECT_TRUE(has(completion, "complete -F _moectl moectl")) << completion;
  Process bench = Process::spawn({MOE_BIN_DIR "/daemon/bench/moe-bench", "layer", "--help"});
  bench.wait(10s);
  EXPECT_TRUE(has(bench.output(), "--ffn-hidden,--ffn INT=")) << bench.output();
  EXPECT_TRUE(has(bench.output(), "--tokens-per-rank,--tokens INT=")) << bench.output();

  Cluster c(1, 2);
  ASSERT_TRUE(c.up());
  const v1::ClusterStatus st = c.status();
  for (const std::string& address : {st.agent_metrics_address(), st.nodes(0).metrics_address()}) {
    const auto colon = address.rfind(':');
    const std::string reply = exchange(address.substr(0, colon), std::stoi(address.substr(colon + 1)),
                                       "GET /healthz HTTP/1.1\r\n\r\n");
    EXPECT_EQ(reply.rfind("HTTP/1.1 200 OK", 0), 0u) << address << ": " << reply;
  }
  // A typo in a spec file names the field it meant.
  const fs::path spec = c.dir() / "typo.json";
  std::ofstream(spec) << R"({"experts": 4, "top_k": 2, "hidden": 16, "ffn_hiden": 8, "tokens_per_rank": 16, "steps": 2})";
  auto [rc, out] = c.ctl({"job", "submit", "-f", spec.string()});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_TRUE(has(out, "unknown field 'ffn_hiden' (did you mean 'ffn_hidden'?)")) << out;
  // The loads file a job leaves runs through moe-placement-sim on its defaults
  // (whose 256 experts in 8 groups on 32 ranks fit no 4-expert file).
  ASSERT_EQ(c.ctl(concat(concat({"job", "submit", "--wait"}, kTiny), {"--steps", "2"}), 60s).first, 0);
  ASSERT_EQ(c.ctl({"placement", "loads", (c.dir() / "loads.txt").string()}).first, 0);
  Process sim = Process::spawn({MOE_BIN_DIR "/agent/placement/moe-placement-sim", "--loads", (c.dir() / "loads.txt").string()});
  EXPECT_EQ(sim.wait(30s), 0) << sim.output();
  // Out-of-range requests exit 2 naming the field.
  std::tie(rc, out) = c.ctl({"top", "--once", "--layer", "9"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_TRUE(has(out, "layer: must be in [0, 1), got 9")) << out;
  std::tie(rc, out) = c.ctl({"placement", "rebalance", "--redundant-experts", "-4"});
  EXPECT_EQ(rc, 2) << out;
  std::tie(rc, out) = c.ctl({"checkpoint", "show", "/nope"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_TRUE(has(out, "/nope does not exist")) << out;
  // After cluster down: no cluster, said so.
  ASSERT_EQ(c.ctl({"cluster", "down"}).first, 0);
  std::tie(rc, out) = c.ctl({"job", "list"});
  EXPECT_EQ(rc, 3) << out;
  EXPECT_TRUE(has(out, "no cluster is up in " + c.dir().string())) << out;
}

}  // namespace
}  // namespace moe::test
