// moectl job submit / status / wait / list / cancel.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <set>
#include <thread>

#include "agent_call.h"
#include "format.h"
#include "job_view.h"
#include "moe/ctl/json.h"
#include "moe/spec/job_spec.h"

namespace moe::ctl {

namespace {

bool finished(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED || s == v1::JOB_STATE_CANCELLED;
}

void print_record(std::ostream& out, const v1::JobResult& j, bool json) {
  if (json) out << to_json(j) << "\n";
  else print_job(out, j);
}

int job_exit(const v1::JobResult& j) {
  if (j.state() == v1::JOB_STATE_SUCCEEDED) return kExitOk;
  return finished(j.state()) ? kExitJobFailed : kExitOk;
}

using Clock = std::chrono::steady_clock;

// How long a wait rides out an agent it cannot reach: a restart on its state
// takes seconds, and the daemons keep the job for their --agent-grace (30 s).
constexpr auto kAgentAwayLimit = std::chrono::seconds(60);

// One agent-side wait of at most `slice`: the record when it ended, or, with
// after_step, once its progress passed that step. An agent that cannot be
// reached (restarting, stopped) is tried again every 0.5 s, said once on `err`,
// until it answers, has been away kAgentAwayLimit or `until` passed; then its
// error is thrown.
v1::JobResult wait_once(rpc::RpcClient& c, const std::string& id, std::optional<int> after_step,
                        std::chrono::milliseconds slice, std::ostream& err,
                        Clock::time_point until = Clock::time_point::max()) {
  v1::Envelope req;
  req.mutable_wait_job()->set_job_id(id);
  if (after_step) req.mutable_wait_job()->set_after_step(*after_step);
  std::optional<Clock::time_point> away;
  for (;;) {
    try {
      v1::JobResult j = c.call(req, slice).job();
      if (away) err << "moectl: the agent answers again" << std::endl;
      return j;
    } catch (const rpc::RpcError& e) {
      const bool unreachable =
          e.code() == v1::ERROR_CODE_UNAVAILABLE || e.code() == v1::ERROR_CODE_DEADLINE_EXCEEDED;
      if (!unreachable || Clock::now() >= until || (away && Clock::now() - *away > kAgentAwayLimit)) throw;
      if (!away) {
        away = Clock::now();
        err << "moectl: " << e.what() << "; waiting up to " << kAgentAwayLimit.count() << " s for the agent to answer ("
            << id << " may be running on)" << std::endl;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  }
}

// The message SIGINT prints while a wait is attached to a job, written by the
// handler itself (async-signal-safe), which then exits 130.
char detach_message[512];

void on_interrupt(int) {
  const ssize_t n = ::write(STDERR_FILENO, detach_message, std::strlen(detach_message));
  (void)n;
  ::_exit(128 + SIGINT);
}

// While alive, Ctrl-C leaves the job as it is and says how to come back to
// it: a queued job stays queued, a running one keeps running.
class DetachNotice {
 public:
  explicit DetachNotice(const std::string& id, v1::JobState state) : id_(id) {
    set_state(state);
    struct sigaction sa {};
    sa.sa_handler = on_interrupt;
    sigaction(SIGINT, &sa, &old_);
  }
  ~DetachNotice() { sigaction(SIGINT, &old_, nullptr); }

  // Rewrites the message (with SIGINT held off, so the handler never reads half of it).
  void set_state(v1::JobState state) {
    if (state == state_) return;
    state_ = state;
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    pthread_sigmask(SIG_BLOCK, &block, &old);
    const char* now = state == v1::JOB_STATE_QUEUED ? "stays queued" : "keeps running";
    std::snprintf(detach_message, sizeof detach_message,
                  "\nmoectl: stopped waiting; %s %s. Reattach: moectl job wait %s; cancel: moectl job cancel %s\n",
                  id_.c_str(), now, id_.c_str(), id_.c_str());
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
  }

 private:
  std::string id_;
  v1::JobState state_ = v1::JOB_STATE_UNSPECIFIED;
  struct sigaction old_ {};
};

// Waits for the job to end (or the timeout), streaming a progress line per step
// to `progress` when given. nullopt: still not ended when the timeout ran out.
// `state` is the job's state when the wait begins; while it is queued the agent
// is asked each second, so Ctrl-C says what the job does now.
std::optional<v1::JobResult> wait_for(rpc::RpcClient& c, const std::string& id, v1::JobState state,
                                      std::optional<double> timeout_s, std::ostream* progress, std::ostream& err) {
  DetachNotice notice(id, state);
  const auto deadline = Clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(timeout_s.value_or(1e9) * 1000));
  int seen = -1;
  v1::JobState seen_state = v1::JOB_STATE_UNSPECIFIED;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return std::nullopt;
    // At least a second per call: a shorter one could run out before the agent's reply arrives.
    const auto longest = state == v1::JOB_STATE_QUEUED ? std::chrono::seconds(1) : std::chrono::seconds(30);
    const auto slice = std::clamp<std::chrono::milliseconds>(left, std::chrono::seconds(1), longest);
    const v1::JobResult j = wait_once(c, id, progress ? std::optional<int>(seen) : std::nullopt, slice, err, deadline);
    if (finished(j.state())) return j;
    state = j.state();
    notice.set_state(state);
    const int step = j.progress().step();
    if (progress && (step > seen || j.state() != seen_state)) {
      *progress << progress_line(j) << std::endl;
      if (j.state() == v1::JOB_STATE_RUNNING) seen = step;
      seen_state = j.state();
    }
  }
}

// The job's state as a wait begins; a queued job's reason said once on `err`
// when no progress lines will say it (a wait must not look like a hang). A job
// the scheduler is about to start ("waiting for its start") is not news.
v1::JobState say_why_queued(rpc::RpcClient& c, const Globals& g, const std::string& id, bool progress,
                            std::ostream& err) {
  v1::Envelope req;
  req.mutable_get_job()->set_job_id(id);
  const v1::JobResult j = c.call(req, g.timeout).job();
  if (!progress && j.state() == v1::JOB_STATE_QUEUED && j.progress().waiting_for() != "its start")
    err << "moectl: " << progress_line(j) << std::endl;
  return j.state();
}

// The end of a wait: the result, or what --timeout means (docs/cli.md#exit-codes).
int report_wait(const Globals& g, const std::string& id, const std::optional<v1::JobResult>& j, double timeout_s,
                std::ostream& out, std::ostream& err) {
  if (!j) {
    err << "moectl: " << id << " had not ended after --timeout " << fmt(timeout_s) << " s; it keeps running\n";
    return kExitTimedOut;
  }
  print_record(out, *j, g.json);
  return job_exit(*j);
}

// --state values: "running,queued" (any case) -> the states.
std::set<v1::JobState> parse_states(const std::vector<std::string>& names) {
  std::set<v1::JobState> out;
  for (const std::string& list : names) {
    size_t at = 0;
    while (at <= list.size()) {
      const size_t comma = std::min(list.find(',', at), list.size());
      std::string name = list.substr(at, comma - at);
      for (char& ch : name) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
      v1::JobState s;
      if (!v1::JobState_Parse("JOB_STATE_" + name, &s) || s == v1::JOB_STATE_UNSPECIFIED)
        throw InvalidArgument("--state: '" + list.substr(at, comma - at) +
                              "' is not one of queued, running, succeeded, failed, cancelled");
      out.insert(s);
      at = comma + 1;
    }
  }
  return out;
}

bool selected(const v1::JobResult& j, const std::vector<std::pair<std::string, std::string>>& selector) {
  for (const auto& [k, v] : selector) {
    const auto it = j.spec().labels().find(k);
    if (it == j.spec().labels().end() || it->second != v) return false;
  }
  return true;
}

// The placement a job will start on when its shape carries one from earlier jobs
// (docs/placement.md#cluster-state): said, with how to start afresh.
void say_placement(const v1::JobResult& job, std::ostream& err) {
  const std::string& p = job.placement();
  if (p.rfind("shape ", 0) != 0) return;  // a shape never placed: its first maps are the solver's
  const std::string shape = p.substr(6, p.find(',') - 6);
  err << "moectl: " << job.job_id() << " will start on the placement in force: " << p
      << " (moectl placement reset --shape " << shape << " starts afresh)" << std::endl;
}

}  // namespace

int job_submit(const Globals& g, const v1::JobSpec& given, const WaitOptions& w, std::ostream& out, std::ostream& err) {
  v1::JobSpec spec = given;
  try {
    spec = spec::with_defaults(spec);
    spec::validate(spec);
  } catch (const moe::InvalidArgument& e) {
    err << "moectl: invalid spec: " << e.what() << "\n";
    return kExitUsage;
  }
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    *req.mutable_submit_job()->mutable_spec() = spec;
    const v1::JobResult job = c.call(req, g.timeout).job();
    if (!w.wait) {
      if (g.json) out << to_json(job) << "\n";
      else out << job.job_id() << std::endl;
      say_placement(job, err);
      return kExitOk;
    }
    if (!g.json) out << job.job_id() << " submitted" << std::endl;  // seen even if the wait is interrupted
    say_placement(job, err);
    std::ostream* progress = isatty(STDERR_FILENO) && !g.json ? &err : nullptr;
    const v1::JobState state = say_why_queued(c, g, job.job_id(), progress != nullptr, err);
    return report_wait(g, job.job_id(), wait_for(c, job.job_id(), state, w.timeout_s, progress, err),
                       w.timeout_s.value_or(0), out, err);
  });
}

int job_status(const Globals& g, const std::string& id, bool watch, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    req.mutable_get_job()->set_job_id(id);
    v1::JobResult j = c.call(req, g.timeout).job();
    if (!watch || finished(j.state())) {
      print_record(out, j, g.json);
      return watch ? job_exit(j) : kExitOk;
    }
    // A line (a JSON object with -o json) per step until the job ends, then its record.
    DetachNotice notice(id, j.state());
    int seen = -2, seen_worlds = j.world_changes_size();
    v1::JobState seen_state = v1::JOB_STATE_UNSPECIFIED;
    while (!finished(j.state())) {
      for (; !g.json && seen_worlds < j.world_changes_size(); ++seen_worlds)  // an elastic job's events
        out << world_change_line(j, j.world_changes(seen_worlds)) << std::endl;
      if (j.progress().step() != seen || j.state() != seen_state) {
        if (g.json) out << to_json(j.progress(), true) << std::endl;
        else out << progress_line(j) << std::endl;
        seen = j.state() == v1::JOB_STATE_RUNNING ? j.progress().step() : -1;
        seen_state = j.state();
      }
      j = wait_once(c, id, std::max(seen, -1), std::chrono::seconds(30), err);
      notice.set_state(j.state());
    }
    print_record(out, j, g.json);
    return job_exit(j);  // a watch ends as a wait does
  });
}

int job_wait(const Globals& g, const std::string& id, const WaitOptions& w, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    std::ostream* progress = isatty(STDERR_FILENO) && !g.json ? &err : nullptr;
    const v1::JobState state = say_why_queued(c, g, id, progress != nullptr, err);
    return report_wait(g, id, wait_for(c, id, state, w.timeout_s, progress, err), w.timeout_s.value_or(0), out, err);
  });
}

int job_list(const Globals& g, const ListOptions& o, std::ostream& out, std::ostream& err) {
  std::set<v1::JobState> states;
  std::vector<std::pair<std::string, std::string>> selector;
  try {
    states = parse_states(o.states);
    for (const std::string& kv : o.selector) {
      const size_t eq = kv.find('=');
      if (eq == std::string::npos || eq == 0) throw InvalidArgument("--selector: expects KEY=VALUE, got '" + kv + "'");
      selector.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
    }
  } catch (const InvalidArgument& e) {
    err << "moectl: " << e.what() << "\n";
    return kExitUsage;
  }
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    req.mutable_list_jobs();
    v1::ListJobsReply list = c.call(req, g.timeout).list_jobs_reply();
    std::vector<v1::JobResult> shown;
    for (const v1::JobResult& j : list.jobs())
      if ((states.empty() || states.count(j.state())) && selected(j, selector)) shown.push_back(j);
    if (g.json) {
      v1::ListJobsReply reply;
      for (auto& j : shown) *reply.add_jobs() = std::move(j);
      out << to_json(reply) << "\n";
      return kExitOk;
    }
    if (list.jobs_size() == 0) out << "no jobs yet\n";
    else if (shown.empty()) out << "no job matches\n";
    else print_job_list(out, shown, terminal_columns(160));
    return kExitOk;
  });
}

int job_cancel(const Globals& g, const std::string& id, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    req.mutable_cancel_job_request()->set_job_id(id);
    const v1::JobResult job = c.call(req, g.timeout).job();
    if (g.json) out << to_json(job) << "\n";
    else out << job.job_id() << " " << state_name(job.state()) << (job.state() == v1::JOB_STATE_RUNNING ? " (cancelling)" : "") << "\n";
    return kExitOk;
  });
}

}  // namespace moe::ctl
