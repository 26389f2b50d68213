// The mistakes a new user makes, each answered honestly (docs/cli.md#exit-codes):
// what was wrong, the valid values or the fix, and the documented exit code.
// Each case failed on the code before it: the comment says what moectl said then.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

#include "local_cluster.h"
#include "process.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using Args = std::vector<std::string>;

bool has(const std::string& out, const std::string& part) { return out.find(part) != std::string::npos; }

const Args& kTiny = kTinyJob;

// A safetensors file holding a router [4, 16] per name, and no experts.
std::string routers_file(const fs::path& file, const std::vector<std::string>& routers) {
  std::string header = "{";
  for (size_t i = 0; i < routers.size(); ++i)
    header += (i ? "," : "") + ("\"" + routers[i] + "\":{\"dtype\":\"F32\",\"shape\":[4,16],\"data_offsets\":[" +
                                std::to_string(256 * i) + "," + std::to_string(256 * (i + 1)) + "]}");
  header += "}";
  std::string size(8, '\0');
  for (int i = 0; i < 8; ++i) size[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  std::ofstream(file, std::ios::binary) << size << header << std::string(256 * routers.size(), '\0');
  return file.string();
}

// moectl's answer to a line that needs no cluster: exit 2 and a message holding `want`.
void refused(const Args& args, const std::string& want) {
  const auto [rc, out] = moectl(args);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_TRUE(has(out, want)) << "wanted '" << want << "' in:\n" << out;
  EXPECT_LT(out.size(), 400u) << "a message is a line or two:\n" << out;
}

// A zero was called missing ("hidden: required (--hidden)"); CLI11's own words
// answered typos ("The following arguments were not expected: 4 --topk", "A
// subcommand is required"); a range printed a double's limit in 300 digits.
TEST(Mistakes, ZerosTyposAndRangesAreNamedForWhatTheyAre) {
  for (const char* field : {"hidden", "steps", "top-k", "experts", "tokens-per-rank"}) {
    Args args = concat(concat({"job", "submit"}, kTiny), {"--steps", "2"});
    args.insert(args.end(), {std::string("--") + field, "0"});  // given last: it counts
    std::string name = field;
    std::replace(name.begin(), name.end(), '-', '_');
    refused(args, name + ": must be >= 1, got 0 (--" + field + ")");
  }
  refused(concat(concat({"job", "submit", "--topk", "4"}, kTiny), {"--steps", "2"}),
          "moectl job submit: unknown flag --topk (did you mean --top-k?)");
  refused({"jobs", "list"}, "moectl: unknown command 'jobs' (did you mean 'job'?)");
  refused({"job", "stats", "job-1"}, "moectl job: unknown command 'stats' (did you mean 'status'?)");
  refused({"placement", "rebalnce"}, "moectl placement: unknown command 'rebalnce' (did you mean 'rebalance'?)");
  refused({"job"}, "moectl job: a command is required: submit, status, wait, cancel, list");
  refused({"job", "wait", "job-1", "--timeout", "0"}, "--timeout: must be a number > 0, got '0'");
  refused({"logs", "agent", "--tail=-3"}, "--tail: must be an integer >= 0, got '-3'");
  const fs::path state = fs::temp_directory_path() / ("moe_mistakes_" + std::to_string(::getpid()));
  refused({"--state-dir", state.string(), "cluster", "up", "--rebalance-every", "abc"},
          "--rebalance-every: must be an integer >= 0, got 'abc'");
  EXPECT_FALSE(fs::exists(state / "agent_address")) << "started an agent anyway";
  refused({"--plaintext", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem", "job", "list"},
          "give --plaintext or the --tls-* files, not both");
  fs::remove_all(state);
}

// The spec file's JSON was read loosely and in protobuf's words: a trailing
// comma passed, a duplicate key took the last value, "TRAIN" said "invalid value
// for type type.googleapis.com/moe.v1.JobSpec.Mode", and no error had a line.
TEST(Mistakes, SpecFilesAreReadStrictlyWithLinesAndColumns) {
  const fs::path dir = fs::temp_directory_path() / ("moe_mistakes_spec_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string head = "{\n  \"experts\": 4, \"top_k\": 2, \"hidden\": 16, \"ffn_hidden\": 8,\n"
                           "  \"tokens_per_rank\": 16, \"steps\": 2";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {head + ",\n}\n", "line 4, column 1: a trailing comma before '}'"},
      {head + ",\n  \"experts\": 32\n}\n", "line 4, column 3: duplicate key \"experts\""},
      {head + ",\n  \"mode\": \"TRAIN\"\n}\n", "line 4, column 11: mode: expects forward | train | serve, got \"TRAIN\""},
      {head + ",\n  \"seed\": \"wide\"\n}\n", "line 4, column 11: seed: expects an integer, got \"wide\""},
      {head + ",\n  \"layers\": \"two\"\n}\n", "line 4, column 13: layers: expects an integer, got \"two\""},
      {head + " // the steps\n}\n", "line 3, column 37: JSON has no comments"},
      {head + "\n}\n{}", "line 5, column 1: text after the end of the object"},
      {head + ",\n  \"ffn_hiden\": 8\n}\n", "line 4, column 3: unknown field 'ffn_hiden' (did you mean 'ffn_hidden'?)"},
  };
  for (const auto& [json, want] : cases) {
    const fs::path file = dir / "spec.json";
    std::ofstream(file) << json;
    refused({"job", "submit", "-f", file.string()}, file.string() + ": " + want);
  }
  // A zero in the file is a value out of range too, and the flags still override the file.
  std::ofstream(dir / "zero.json")
      << R"({"experts": 4, "top_k": 2, "hidden": 0, "ffn_hidden": 8, "tokens_per_rank": 16, "steps": 2})";
  refused({"job", "submit", "-f", (dir / "zero.json").string()}, "hidden: must be >= 1, got 0 (--hidden)");
  fs::remove_all(dir);
}

// moectl took the default state directory's certificates for whatever agent
// --agent named, and had no --plaintext: after one local cluster had run, a
// plaintext agent could not be reached ("the peer does not speak TLS"). Now it
// names the fix, and sends no token in clear unless told to (issue 44).
TEST(Mistakes, TheStateDirectorysCertificatesGoOnlyToItsOwnAgent) {
  Cluster tls_cluster(1, 1);  // leaves tls/ in its state directory, as `cluster up` does in ~/.local/state/moed
  ASSERT_TRUE(tls_cluster.up());
  Cluster plain(1, 1, {"--plaintext"});
  ASSERT_TRUE(plain.up());
  const fs::path home = tls_cluster.dir() / "home";
  fs::create_directories(home / ".local" / "state");
  fs::create_directory_symlink(tls_cluster.dir(), home / ".local" / "state" / "moed");
  const fs::path token = plain.dir() / "token";
  // The environment moectl runs in: HOME with that state directory as its default, no MOE_STATE_DIR.
  const std::string old_home = std::getenv("HOME") ? std::getenv("HOME") : "";
  const std::string old_state = std::getenv("MOE_STATE_DIR") ? std::getenv("MOE_STATE_DIR") : "";
  ::setenv("HOME", home.c_str(), 1);
  ::unsetenv("MOE_STATE_DIR");
  const Args to_plain = {"--agent", plain.agent(), "--token-file", token.string(), "job", "list"};
  // Without TLS files for that agent moectl will not send the token in clear unasked.
  auto [rc, out] = moectl(to_plain);
  EXPECT_EQ(rc, 2) << out;
  EXPECT_TRUE(has(out, "no TLS files for the agent at " + plain.agent() + ": give --tls-ca, --tls-cert and "
                       "--tls-key (moectl tls create makes them), or --plaintext"))
      << out;
  std::tie(rc, out) = moectl(concat({"--plaintext"}, to_plain));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(has(out, "no jobs yet")) << out;
  // Its own agent still gets them: no flags at all reach the TLS cluster.
  std::tie(rc, out) = moectl({"cluster", "status"});
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(has(out, tls_cluster.agent())) << out;
  // --plaintext is moectl's own flag too, over a state directory given by name.
  std::tie(rc, out) = moectl(concat({"--plaintext", "--state-dir", tls_cluster.dir().string()}, to_plain));
  EXPECT_EQ(rc, 0) << out;
  ::setenv("HOME", old_home.c_str(), 1);
  if (!old_state.empty()) ::setenv("MOE_STATE_DIR", old_state.c_str(), 1);
}

// On a 2x1 cluster, in one run: weights refused at submit, not on the ranks;
// a finished job's cancel and a down cluster's down said nothing wrong and
// exited 0; a queued submit --wait said "keeps running" on Ctrl-C and never
// why it waited; a node's loss was told in UCX's words; an elastic world change
// was only a suffix of the watch lines; placement carried over silently; at 80
// columns the queued job's fix and top's ETA were cut off.
TEST(Mistakes, ClusterVerbsSayWhatIsTrue) {
  Cluster c(2, 1);
  ASSERT_TRUE(c.up());
  // Weights: a missing file, and a 2-layer file asked for 3 layers.
  auto [rc, out] = c.ctl(concat(concat({"job", "submit"}, kTiny), {"--steps", "2", "--weights", "/nonexistent.safetensors"}));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_TRUE(has(out, "weights: /nonexistent.safetensors does not exist")) << out;
  const std::string two = routers_file(c.dir() / "two.safetensors", {"layers.0.gate.weight", "layers.1.gate.weight"});
  std::tie(rc, out) = c.ctl(concat(concat({"job", "submit"}, kTiny),
                                   {"--steps", "2", "--layers", "3", "--weights", two, "--weights-prefix", "layers.{layer}."}));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_TRUE(has(out, "weights: job layer 2 reads layers.2.gate.weight, which " + two +
                           " does not hold (it has the routers of checkpoint layers 0-1)"))
      << out;

  // An elastic job that keeps every expert on both nodes; a watch sees node1's loss as an event.
  std::tie(rc, out) = c.ctl(concat(concat({"job", "submit"}, kTiny),
                                   {"--steps", "1000000", "--elastic", "--min-node-replicas", "2", "--elastic-batch", "per_rank"}));
  ASSERT_EQ(rc, 0) << out;
  const std::string elastic = out.substr(0, out.find('\n'));
  ASSERT_TRUE(poll_until([&] { return c.job(elastic).progress().step() >= 3; }, 60s)) << c.logs();
  // Ctrl-C on a queued submit --wait: it said why it waits, and that the job stays queued.
  Process queued = Process::spawn(concat(concat({MOE_BIN_DIR "/cli/moectl", "--state-dir", c.dir().string(), "job",
                                                 "submit", "--wait"},
                                                kTiny),
                                         {"--steps", "2"}));
  ASSERT_TRUE(poll_until([&] { return has(queued.output(), "QUEUED: waiting for " + elastic + " to end"); }, 30s))
      << queued.output();
  std::smatch submitted;
  const std::string queued_out = queued.output();
  ASSERT_TRUE(std::regex_search(queued_out, submitted, std::regex("(job-[0-9]+) submitted"))) << queued_out;
  const std::string waiter = submitted[1];
  queued.kill(SIGINT);
  EXPECT_EQ(queued.wait(10s), 130) << queued.output();
  EXPECT_TRUE(has(queued.output(), waiter + " stays queued")) << queued.output();
  ASSERT_EQ(c.ctl({"job", "cancel", waiter}).first, 0);
  // top at 80 columns keeps the ETA.
  const std::string top = c.ctl({"top", "--once"}).second;
  EXPECT_TRUE(std::regex_search(top, std::regex(elastic + " RUNNING +step [0-9]+/1000000 +eta "))) << top;
  Process watch = Process::spawn({MOE_BIN_DIR "/cli/moectl", "--state-dir", c.dir().string(), "job", "status", elastic, "-w"});
  std::this_thread::sleep_for(300ms);  // the watch attached
  ::kill(c.pid_of("node1"), SIGKILL);
  ASSERT_TRUE(poll_until([&] { return c.job(elastic).world_changes_size() >= 1; }, 30s)) << c.logs();
  ASSERT_TRUE(poll_until([&] { return has(watch.output(), elastic + " world 1 at step "); }, 10s)) << watch.output();
  EXPECT_TRUE(std::regex_search(watch.output(), std::regex(elastic + " world 1 at step [0-9]+: lost node1 \\(.*\\); 2 -> 1 ranks")))
      << watch.output();
  ASSERT_EQ(c.ctl({"job", "cancel", elastic}).first, 0);
  EXPECT_EQ(watch.wait(30s), 1) << watch.output();

  // A queued job's fix, cut at 80 columns in the table, follows it whole.
  const std::string blocked = c.ctl(concat(concat({"job", "submit"}, kTiny), {"--steps", "2"})).second;
  const std::string blocked_id = blocked.substr(0, blocked.find('\n'));
  ASSERT_TRUE(poll_until([&] { return has(c.job(blocked_id).progress().waiting_for(), "node node1: dead"); }, 30s))
      << c.job(blocked_id).progress().waiting_for();
  {
    const ScopedEnv columns("COLUMNS", "80");
    std::tie(rc, out) = c.ctl({"job", "list"});
  }
  ASSERT_EQ(rc, 0) << out;
  for (const std::string& l : output_lines(out)) EXPECT_LE(l.size(), 80u) << l;
  EXPECT_TRUE(has(out, blocked_id + " is waiting for node node1: dead")) << out;
  EXPECT_TRUE(has(out, "moectl node restart node1")) << out;
  ASSERT_EQ(c.ctl({"node", "restart", "node1"}, 90s).first, 0) << c.logs();
  ASSERT_EQ(c.ctl({"job", "wait", blocked_id}, 60s).first, 0) << c.logs();

  // The shape 4x1@2x1 keeps the elastic job's redundancy: said at submit, and reset.
  std::tie(rc, out) = c.ctl(concat(concat({"job", "submit"}, kTiny), {"--steps", "1000000"}));
  ASSERT_EQ(rc, 0) << out;
  const std::string plain = out.substr(0, out.find('\n'));
  EXPECT_TRUE(has(out, plain + " will start on the placement in force: shape 4x1@2x1, epoch ")) << out;
  // (the job between them started on those maps too, and asked for no redundancy of its own)
  EXPECT_TRUE(has(out, ", 4 slots per rank (4 redundant), from " + elastic + "'s start")) << out;
  EXPECT_TRUE(has(out, "(moectl placement reset --shape 4x1@2x1 starts afresh)")) << out;
  ASSERT_TRUE(poll_until([&] { return c.job(plain).progress().step() >= 3; }, 60s)) << c.logs();
  std::tie(rc, out) = c.ctl({"placement", "reset", "--shape", "4x1@2x1"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_TRUE(has(out, "runs on the shape 4x1@2x1; reset it when the job ends")) << out;

  // A node lost by a job that is not elastic: the node first, then what the ranks saw.
  ::kill(c.pid_of("node1"), SIGKILL);
  std::tie(rc, out) = c.ctl({"job", "wait", plain}, 60s);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex("message +node node1 \\(ranks 1-1\\) stopped responding after [0-9]+ "
                                                "complete steps; a job that is not elastic fails with its node")))
      << out;
  ASSERT_EQ(c.ctl({"node", "restart", "node1"}, 90s).first, 0) << c.logs();
  std::tie(rc, out) = c.ctl({"placement", "reset", "--shape", "4x1@2x1"});
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(has(out, "reset 4x1@2x1")) << out;
  std::tie(rc, out) = c.ctl(concat(concat({"job", "submit", "--wait"}, kTiny), {"--steps", "2"}), 60s);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_FALSE(has(out, "will start on the placement in force")) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex("started on +shape 4x1@2x1, epoch "))) << out;
  EXPECT_TRUE(has(out, ", 2 slots per rank (0 redundant), from job-")) << out;

  // Cancelling what already ended, and stopping what is not up.
  const std::string done = out.substr(0, out.find(' '));  // "job-N submitted" comes first
  std::tie(rc, out) = c.ctl({"job", "cancel", done});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_TRUE(has(out, done + " already ended (SUCCEEDED): nothing to cancel")) << out;
  ASSERT_EQ(c.ctl({"cluster", "down"}).first, 0);
  std::tie(rc, out) = c.ctl({"cluster", "down"});
  EXPECT_EQ(rc, 3) << out;
  EXPECT_TRUE(has(out, "no cluster is up in " + c.dir().string() + ": nothing to stop")) << out;
}

}  // namespace
}  // namespace moe::test
