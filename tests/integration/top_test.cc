// moectl top as a user meets it (docs/metrics.md#live-load, docs/cli.md#output):
// one frame and the JSON reply on a fresh cluster and during a skewed job (the
// hottest expert it names is the job's), an unreachable agent; and the live view
// in a real terminal (tmux, 80 columns): it refreshes in place within the width,
// and q, Ctrl-C and SIGTERM each leave the terminal as they found it; the first
// run starts before any job.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <regex>
#include <sstream>
#include <thread>

#include "ci_skip.h"
#include "local_cluster.h"
#include "process.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

const std::string kMoectl = std::string(MOE_BIN_DIR) + "/cli/moectl";

bool has(const std::string& out, const std::string& part) { return out.find(part) != std::string::npos; }

// Every line at most `width` columns (the frame is ASCII).
void expect_within(const std::string& text, size_t width) {
  for (const auto& l : output_lines(text)) EXPECT_LE(l.size(), width) << "'" << l << "'";
}

v1::LiveLoad parse_live_load(const std::string& json) {
  v1::LiveLoad l;
  EXPECT_TRUE(parse_output(json, l));
  return l;
}

int argmax(const google::protobuf::RepeatedField<double>& v) {
  return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());
}

// The experts `moectl top` names hottest, per layer in order.
std::vector<int> hottest_named(const std::string& frame) {
  std::vector<int> ids;
  const std::regex re(R"(^  hottest: (\d+) )");
  for (const auto& l : output_lines(frame)) {
    std::smatch m;
    if (std::regex_search(l, m, re)) ids.push_back(std::stoi(m[1]));
  }
  return ids;
}

TEST(Top, OnceAndJsonOnAFreshClusterAndDuringASkewedJob) {
  Cluster c(2, 2);
  ASSERT_TRUE(c.up());
  // No job yet: a frame that says so, and a reply with no job and no layers.
  auto [rc, frame] = c.ctl({"top", "--once"});
  ASSERT_EQ(rc, 0) << frame;
  EXPECT_TRUE(has(frame, "no job has run yet")) << frame;
  EXPECT_TRUE(has(frame, "2/2 nodes alive, 4 ranks")) << frame;
  EXPECT_FALSE(has(frame, "\x1b")) << "escape codes in output that is not a terminal";
  expect_within(frame, 80);
  auto [jrc, json] = c.ctl({"--output", "json", "top"});
  ASSERT_EQ(jrc, 0) << json;
  v1::LiveLoad empty = parse_live_load(json);
  EXPECT_FALSE(empty.has_job());
  EXPECT_EQ(empty.layers_size(), 0);
  EXPECT_EQ(empty.nodes_alive(), 2);

  // A skewed job past a full window (32 steps), then cancelled.
  const auto [src, submitted] = c.ctl({"job", "submit", "--experts", "16", "--top-k", "4", "--layers", "2", "--hidden",
                                       "32", "--ffn-hidden", "16", "--tokens-per-rank", "64", "--steps", "1000000",
                                       "--skew", "zipf:1.2", "--seed", "5"});
  ASSERT_EQ(src, 0) << submitted;
  const std::string id = submitted.substr(0, submitted.find('\n'));
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (c.job(id).steps_completed() < 40 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(20ms);  // polling the agent for the job's progress
  std::tie(rc, frame) = c.ctl({"top", "--once"});
  std::tie(jrc, json) = c.ctl({"--output", "json", "top"});
  ASSERT_EQ(rc, 0) << frame;
  ASSERT_EQ(jrc, 0) << json;
  c.ctl({"job", "cancel", id});
  const v1::JobResult job = parse_result(c.ctl({"--output", "json", "job", "wait", id}, 60s).second);
  ASSERT_EQ(job.state(), v1::JOB_STATE_CANCELLED) << job.message() << c.logs();

  EXPECT_TRUE(has(frame, id + " RUNNING   step ")) << frame;
  EXPECT_TRUE(has(frame, "tokens/s")) << frame;
  EXPECT_TRUE(has(frame, "layer 1   epoch 1   balancedness ")) << frame;
  EXPECT_TRUE(has(frame, "  rank 3 [")) << frame;
  EXPECT_FALSE(has(frame, "\x1b"));
  expect_within(frame, 80);
  const v1::LiveLoad live = parse_live_load(json);
  ASSERT_EQ(live.layers_size(), 2) << json;
  EXPECT_EQ(live.job().job_id(), id);
  EXPECT_EQ(live.layers(0).window_steps(), 32) << "a full window";
  const std::vector<int> named = hottest_named(frame);
  ASSERT_EQ(named.size(), 2u) << frame;
  ASSERT_EQ(job.expert_tokens_size(), 2);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(named[l], argmax(job.expert_tokens(l).tokens()))
        << "layer " << l << ": the job's hottest expert\n" << frame;
    EXPECT_EQ(named[l], argmax(live.layers(l).expert_loads())) << "layer " << l << ": the window's hottest expert";
  }
}

TEST(Top, AnUnreachableAgentExits3) {
  for (const auto& mode : {std::vector<std::string>{"--once"}, std::vector<std::string>{}}) {
    std::vector<std::string> argv = {kMoectl, "--state-dir", "/nonexistent", "--agent", "127.0.0.1:1", "top"};
    argv.insert(argv.end(), mode.begin(), mode.end());
    Process p = Process::spawn(argv);
    EXPECT_EQ(p.wait(30s), 3) << p.output();
    EXPECT_TRUE(has(p.output(), "moectl: ")) << p.output();
    EXPECT_FALSE(has(p.output(), "\x1b")) << "the screen is untouched";
  }
}

// The path of a program on PATH ("" if none).
std::string on_path(const std::string& name) {
  std::istringstream dirs(std::getenv("PATH") ? std::getenv("PATH") : "/usr/bin:/bin");
  for (std::string d; std::getline(dirs, d, ':');)
    if (::access((fs::path(d) / name).c_str(), X_OK) == 0) return (fs::path(d) / name).string();
  return "";
}

// tmux, installed with apt-get when missing ("" when that fails).
std::string find_tmux() {
  if (const std::string t = on_path("tmux"); !t.empty()) return t;
  if (::geteuid() == 0 && !on_path("apt-get").empty()) {
    Process p = Process::spawn({on_path("apt-get"), "install", "-y", "-qq", "tmux"});
    p.wait(300s);
  }
  return on_path("tmux");
}

// A tmux server of its own with one detached 80x40 pane running bash at a known
// prompt.
class Terminal {
 public:
  Terminal(std::string tmux, const fs::path& dir) : tmux_(std::move(tmux)), socket_((dir / "tmux.sock").string()) {
    run({"new-session", "-d", "-s", "t", "-x", "80", "-y", "40", "env PS1='top-test$ ' bash --norc --noprofile"});
  }
  ~Terminal() { run({"kill-server"}); }

  // Runs a tmux command; returns its output.
  std::string run(std::vector<std::string> args) const {
    args.insert(args.begin(), {tmux_, "-S", socket_});
    Process p = Process::spawn(args);
    EXPECT_EQ(p.wait(10s), 0) << args[3] << ": " << p.output();
    return p.output();
  }
  // The pane's text, wrapped lines joined (so a line wider than the pane shows).
  std::string capture() const { return run({"capture-pane", "-p", "-J", "-t", "t"}); }
  std::string format(const std::string& f) const {
    std::string s = run({"display-message", "-p", "-t", "t", f});
    while (!s.empty() && s.back() == '\n') s.pop_back();
    return s;
  }
  void type(const std::string& line) const {
    run({"send-keys", "-t", "t", "-l", line});
    run({"send-keys", "-t", "t", "Enter"});
  }
  void key(const std::string& k) const { run({"send-keys", "-t", "t", k}); }
  // Polls the pane until pred(capture) holds (the last capture in `last`).
  bool wait_for(const std::function<bool(const std::string&)>& pred, std::chrono::seconds timeout,
                std::string& last) const {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (!pred(last = capture())) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(50ms);  // polling the terminal's contents
    }
    return true;
  }

 private:
  std::string tmux_, socket_;
};

int step_in(const std::string& frame) {
  std::smatch m;
  return std::regex_search(frame, m, std::regex(R"(RUNNING   step (\d+)/)")) ? std::stoi(m[1]) : -1;
}

// The pid of the pane shell's child (moectl).
pid_t pane_child(const Terminal& t) {
  const std::string shell = t.format("#{pane_pid}");
  std::istringstream kids(read_text_file("/proc/" + shell + "/task/" + shell + "/children"));
  pid_t pid = -1;
  kids >> pid;
  return pid;
}

class TopInATerminal : public ::testing::Test {
 protected:
  void SetUp() override {
    tmux = find_tmux();
    if (tmux.empty()) MOE_SKIP_OR_FAIL_IN_CI("tmux is not installed and apt-get install tmux failed");
  }
  std::string tmux;
};

// The first run starts on the fresh cluster (no job yet) and must show the job
// submitted while it runs; the other two start during it.
TEST_F(TopInATerminal, RefreshesInPlaceWithinTheWidthAndEveryWayOutRestoresTheTerminal) {
  Cluster c(1, 2);
  ASSERT_TRUE(c.up());
  Terminal t(tmux, c.dir());
  std::string screen;
  ASSERT_TRUE(t.wait_for([](const std::string& s) { return has(s, "top-test$"); }, 10s, screen)) << screen;

  // How each run ends: the key or signal, and the exit status it must give.
  struct Exit {
    std::string how;
    int status;
  };
  int run = 0;
  for (const Exit& e : {Exit{"q", 0}, Exit{"C-c", 130}, Exit{"SIGTERM", 143}}) {
    SCOPED_TRACE(e.how);
    const fs::path before = c.dir() / ("stty." + std::to_string(run) + ".before");
    const fs::path after = c.dir() / ("stty." + std::to_string(run) + ".after");
    // Typed as "top-exited-$?-runN", printed as "top-exited-STATUS-runN".
    const std::string tag = "-run" + std::to_string(run++);
    const std::regex done("top-exited-[0-9]+" + tag);
    t.type("stty -g > " + before.string() + "; " + kMoectl + " --state-dir " + c.dir().string() +
           " top; echo top-exited-$?" + tag + "; stty -g > " + after.string());
    if (tag == "-run0") {  // on the fresh cluster
      ASSERT_TRUE(t.wait_for([](const std::string& s) { return has(s, "no job has run yet"); }, 15s, screen))
          << screen;
      EXPECT_EQ(t.format("#{alternate_on} #{cursor_flag}"), "1 0") << "alternate screen, cursor hidden";
      EXPECT_TRUE(has(screen, "1/1 nodes alive, 2 ranks")) << screen;
      expect_within(screen, 80);
      c.start_long_job(2);
    }
    ASSERT_TRUE(t.wait_for([](const std::string& s) { return has(s, "hottest:") && step_in(s) >= 0; }, 15s, screen))
        << screen;
    EXPECT_EQ(t.format("#{alternate_on} #{cursor_flag}"), "1 0") << "alternate screen, cursor hidden";
    expect_within(screen, 80);
    EXPECT_LE(output_lines(screen).size(), 40u);
    // It refreshes in place: the step count moves on the same screen.
    const int first = step_in(screen);
    ASSERT_TRUE(t.wait_for([&](const std::string& s) { return step_in(s) > first; }, 10s, screen)) << screen;
    expect_within(screen, 80);
    EXPECT_TRUE(has(screen, "moectl top   agent ")) << "the header stays on top:\n" << screen;

    if (e.how == "SIGTERM") ::kill(pane_child(t), SIGTERM);
    else t.key(e.how);
    ASSERT_TRUE(t.wait_for([&](const std::string& s) { return std::regex_search(s, done) && fs::exists(after); }, 10s,
                           screen))
        << screen;
    EXPECT_TRUE(has(screen, "top-exited-" + std::to_string(e.status) + tag)) << screen;
    EXPECT_EQ(t.format("#{alternate_on} #{cursor_flag}"), "0 1") << "main screen back, cursor shown";
    EXPECT_FALSE(has(screen, "hottest:")) << "the frame stayed on the main screen:\n" << screen;
    ASSERT_TRUE(t.wait_for([&](const std::string&) { return !read_text_file(after).empty(); }, 5s, screen));
    EXPECT_EQ(read_text_file(after), read_text_file(before)) << "terminal modes after top differ from before";
    ASSERT_TRUE(t.wait_for(
        [](const std::string& s) {
          auto l = output_lines(s);
          while (!l.empty() && l.back().find_first_not_of(' ') == std::string::npos) l.pop_back();
          return !l.empty() && l.back().rfind("top-test$", 0) == 0 &&
                 l.back().find_first_not_of(' ', 9) == std::string::npos;
        },
        5s, screen))
        << "the shell prompt is back:\n" << screen;
  }
}

// An agent that goes away (restarting, say) does not end the view: the last data
// stays under a line saying so, and the view follows the agent when it is back.
TEST_F(TopInATerminal, RidesOutAnAgentRestart) {
  Cluster c(1, 1);
  ASSERT_TRUE(c.up());
  Terminal t(tmux, c.dir());
  std::string screen;
  ASSERT_TRUE(t.wait_for([](const std::string& s) { return has(s, "top-test$"); }, 10s, screen)) << screen;
  t.type(kMoectl + " --state-dir " + c.dir().string() + " top; echo top-exited-$?");
  ASSERT_TRUE(t.wait_for([](const std::string& s) { return has(s, "no job has run yet"); }, 15s, screen)) << screen;
  c.kill_agent();
  ASSERT_TRUE(t.wait_for([](const std::string& s) { return has(s, "agent unreachable, retrying"); }, 15s, screen))
      << screen;
  EXPECT_TRUE(has(screen, "no job has run yet")) << "the last data stays:\n" << screen;
  expect_within(screen, 80);
  Process agent = c.start_agent_again();
  ASSERT_TRUE(t.wait_for([](const std::string& s) { return !has(s, "agent unreachable"); }, 15s, screen)) << screen;
  t.key("q");
  ASSERT_TRUE(t.wait_for([](const std::string& s) { return has(s, "top-exited-0"); }, 10s, screen)) << screen;
}

}  // namespace
}  // namespace moe::test
