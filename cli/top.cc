// moectl top (docs/metrics.md#live-load, docs/cli.md#output): the agent's
// live-load reply, polled once a second and drawn in place on a terminal until
// `q`; one frame with --once (no escape codes); the reply as JSON with --output
// json. Output that is not a terminal gets a frame a second, one after the other,
// until SIGINT or SIGTERM.
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <ctime>
#include <optional>

#include "moe/ctl/json.h"
#include "agent_call.h"
#include "moe/spec/job_spec.h"
#include "top_frame.h"

namespace moe::ctl {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

volatile sig_atomic_t g_stop = 0;     // SIGINT or SIGTERM: its number
volatile sig_atomic_t g_resized = 0;  // SIGWINCH

void on_signal(int sig) {
  if (sig == SIGWINCH) g_resized = 1;
  else g_stop = sig;
}

// Columns and lines of the terminal on fd; 80 columns and no height limit when
// it is not one.
std::pair<int, int> terminal_size(int fd) {
  winsize ws{};
  if (::ioctl(fd, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return {ws.ws_col, ws.ws_row};
  return {80, 0};
}

std::string clock_text() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::localtime_r(&t, &tm);
  char buf[16];
  std::strftime(buf, sizeof buf, "%H:%M:%S", &tm);
  return buf;
}

// SIGINT, SIGTERM and SIGWINCH set flags while the view runs (no SA_RESTART: a
// wait returns at once); the previous handlers are back after.
class SignalScope {
 public:
  SignalScope() {
    g_stop = 0;
    g_resized = 0;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &sa, &saved_[i]);
  }
  ~SignalScope() {
    for (size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &saved_[i], nullptr);
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

 private:
  static constexpr std::array<int, 3> kSignals = {SIGINT, SIGTERM, SIGWINCH};
  std::array<struct sigaction, 3> saved_{};
};

// The terminal of the interactive view: input non-canonical without echo (keys
// arrive one by one), the alternate screen, the cursor hidden. The destructor
// restores all three, also when an error or a signal ends the view.
class Screen {
 public:
  Screen(int in, std::ostream& out) : in_(in), out_(out) {
    if (::tcgetattr(in_, &saved_) == 0) {
      termios raw = saved_;
      raw.c_lflag &= ~(ICANON | ECHO);
      raw.c_cc[VMIN] = 0;
      raw.c_cc[VTIME] = 0;
      raw_ = ::tcsetattr(in_, TCSAFLUSH, &raw) == 0;
    }
    out_ << "\x1b[?1049h\x1b[?25l" << std::flush;  // alternate screen, cursor hidden
  }
  ~Screen() {
    out_ << "\x1b[?25h\x1b[?1049l" << std::flush;  // cursor shown, main screen back
    if (raw_) ::tcsetattr(in_, TCSAFLUSH, &saved_);
  }
  Screen(const Screen&) = delete;
  Screen& operator=(const Screen&) = delete;

  // Draws `height` lines from the top left (the frame, then blank ones), each
  // erased first; no newline after the last, so nothing scrolls.
  void draw(const std::vector<std::string>& lines, int height) {
    const size_t n = height > 0 ? static_cast<size_t>(height) : lines.size();
    std::string s = "\x1b[H";
    for (size_t i = 0; i < n; ++i) {
      s += "\x1b[2K";
      if (i < lines.size()) s += lines[i];
      if (i + 1 < n) s += "\r\n";
    }
    out_ << s << std::flush;
  }

 private:
  int in_;
  std::ostream& out_;
  termios saved_{};
  bool raw_ = false;
};

v1::LiveLoad fetch(rpc::RpcClient& c, const Globals& g) {
  v1::Envelope req;
  req.mutable_live_load();
  return c.call(req, std::min(g.timeout, std::chrono::milliseconds(5000))).live_load_reply();
}

// `lost`: why the last poll failed, shown under the title (empty: it did not).
std::vector<std::string> frame(const v1::LiveLoad& load, const Resolved& r, const TopOptions& o, bool keys,
                               const std::string& lost = "") {
  const auto [width, height] = terminal_size(STDOUT_FILENO);
  std::vector<std::string> lines = render_top(
      load, {.width = width, .height = keys ? height : 0, .agent = r.agent, .clock = clock_text(), .layer = o.layer,
             .keys = keys});
  if (!lost.empty())
    lines.insert(lines.begin() + std::min<size_t>(1, lines.size()),
                 ("agent unreachable, retrying each second; last data shown: " + lost).substr(0, width));
  return lines;
}

enum class Wake { kTick, kResize, kQuit, kSignal };

// Waits until `until` for a key on in (-1: none to read), a resize or a signal.
Wake wait_input(int& in, Clock::time_point until) {
  for (;;) {
    if (g_stop) return Wake::kSignal;
    if (g_resized) {
      g_resized = 0;
      return Wake::kResize;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    if (left <= 0) return Wake::kTick;
    pollfd p{in, POLLIN, 0};
    if (::poll(&p, in >= 0 ? 1 : 0, static_cast<int>(left)) <= 0) continue;  // timeout or a signal
    char keys[64];
    const ssize_t n = ::read(in, keys, sizeof keys);
    if (n <= 0) in = -1;  // end of input: nothing more to read
    for (ssize_t i = 0; i < n; ++i)
      if (keys[i] == 'q' || keys[i] == 'Q') return Wake::kQuit;
  }
}

// The view until q (exit 0) or SIGINT / SIGTERM (exit 128 + the signal).
// Frames go to `out`, drawn in place when stdout is a terminal. An agent that
// stops answering after the first frame leaves the last data on screen under a
// line saying so, and is polled again each second.
int run_view(rpc::RpcClient& c, const Globals& g, const Resolved& r, const TopOptions& o, std::ostream& out) {
  v1::LiveLoad load = fetch(c, g);  // before the screen changes: unreachable exits 3 on a clean terminal
  const bool tty = ::isatty(STDOUT_FILENO);
  SignalScope signals;
  std::optional<Screen> screen;
  if (tty) screen.emplace(STDIN_FILENO, out);
  int in = STDIN_FILENO;
  auto next = Clock::now() + 1s;
  std::string lost;  // the agent went away (restarting, say): keep the view, keep polling
  for (;;) {
    const std::vector<std::string> lines = frame(load, r, o, tty, lost);
    if (screen) screen->draw(lines, terminal_size(STDOUT_FILENO).second);
    else {
      for (const auto& l : lines) out << l << "\n";
      out << "\n" << std::flush;
    }
    Wake w;
    while ((w = wait_input(in, next)) == Wake::kResize && !screen) {
    }
    if (w == Wake::kQuit) return kExitOk;
    if (w == Wake::kSignal) return 128 + g_stop;
    if (w == Wake::kTick) {
      try {
        load = fetch(c, g);
        lost.clear();
      } catch (const rpc::RpcError& e) {
        if (exit_code_of(e) != kExitUnreachable) throw;
        lost = e.what();
      }
      next = Clock::now() + 1s;
    }
  }
}

}  // namespace

int top(const Globals& g, const TopOptions& o, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved& r) {
    const v1::LiveLoad first = fetch(c, g);
    // A layer the shape does not have is a usage error, as in placement show.
    if (o.layer && first.layers_size() > 0 && (*o.layer < 0 || *o.layer >= first.layers_size())) {
      err << "moectl: layer: must be in [0, " << first.layers_size() << "), got " << *o.layer << "\n";
      return kExitUsage;
    }
    if (g.json) {
      out << to_json(first) << "\n";
      return kExitOk;
    }
    if (o.once) {
      for (const auto& l : frame(first, r, o, false)) out << l << "\n";
      return kExitOk;
    }
    return run_view(c, g, r, o, out);
  });
}

}  // namespace moe::ctl
