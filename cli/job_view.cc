#include "job_view.h"

#include "format.h"
#include "moe/base/clock.h"

namespace moe::ctl {
namespace {

using Rows = std::vector<std::pair<std::string, std::string>>;

// "router 0.002, dispatch 0.01, ..." for every phase that took time.
std::string phases_line(const v1::PhaseSeconds& p) {
  const auto* d = v1::PhaseSeconds::descriptor();
  std::string line;
  for (int f = 0; f < d->field_count(); ++f) {
    const double v = v1::PhaseSeconds::GetReflection()->GetDouble(p, d->field(f));
    if (v > 0) line += (line.empty() ? "" : ", ") + d->field(f)->name() + " " + rate_text(1e3 * v);
  }
  return line;
}

// Seconds from start to the end (or to now while it runs); -1 before it started.
double duration_of(const v1::JobResult& j) {
  if (j.started_unix_ms() <= 0) return -1;
  const double end = j.finished_unix_ms() > 0 ? j.finished_unix_ms() : unix_ms();
  return (end - j.started_unix_ms()) / 1000;
}

std::string step_text(const v1::JobResult& j) {
  const int steps = j.spec().steps();
  const int step = j.state() == v1::JOB_STATE_RUNNING ? j.progress().step() : static_cast<int>(j.steps_completed());
  return std::to_string(step) + "/" + std::to_string(steps);
}

void progress_rows(const v1::JobResult& j, Rows& rows) {
  const v1::JobProgress& p = j.progress();
  const int steps = j.spec().steps();
  rows.push_back({"step", step_text(j) + " (" + fmt(steps > 0 ? 100.0 * p.step() / steps : 0, 3) + "%)"});
  if (p.has_loss()) rows.push_back({"loss", fmt(p.loss()) + " (latest step)"});
  if (p.recent_steps() == 0) {
    rows.push_back({"tokens/s", "- (no step has completed yet)"});
  } else {
    const std::string over = " (median of the last " + std::to_string(p.recent_steps()) + " steps)";
    rows.push_back({"tokens/s", rate_text(p.tokens_per_second()) + over});
    rows.push_back({"step time", human_seconds(p.step_seconds()) + over});
  }
  if (p.has_eta_seconds()) rows.push_back({"eta", human_seconds(p.eta_seconds())});
  rows.push_back({"placement epoch", std::to_string(p.epoch() > 0 ? p.epoch() : static_cast<int64_t>(j.placement_epoch()))});
  rows.push_back({"balancedness", p.has_window_balancedness() ? fmt(p.window_balancedness(), 3) + " (load window)"
                                  : p.recent_steps() == 0   ? "- (no step has completed yet)"
                                                            : "- (the load window is empty)"});
}

// A serving job's latest window (docs/serving.md#statistics).
void serving_rows(const v1::JobResult& j, Rows& rows) {
  const v1::ServeProgress& s = j.progress().serve();
  if (s.window_seconds() <= 0) {
    rows.push_back({"calls", "- (no window has completed yet)"});
    return;
  }
  const std::string over = " (last " + human_seconds(s.window_seconds()) + ")";
  rows.push_back({"clients", std::to_string(s.clients())});
  rows.push_back({"calls/s", rate_text(s.calls_per_second()) + (s.failed_per_second() > 0
                                                                    ? ", failed " + rate_text(s.failed_per_second())
                                                                    : std::string()) +
                                 over});
  rows.push_back({"tokens/s", rate_text(s.rows_per_second()) + " (rows of the calls answered)"});
  rows.push_back({"step rows", fmt(s.step_rows(), 3) + " (mean rows a serve step computed, all ranks)"});
  rows.push_back({"queued rows", std::to_string(s.queued_rows())});
  if (j.spec().serve_train()) rows.push_back({"optimizer steps", std::to_string(s.optimizer_steps())});
  for (const v1::ServeLane& l : s.lanes())
    rows.push_back({"layer " + std::to_string(l.layer()) + (l.backward() ? " backward" : " forward"),
                    rate_text(l.calls_per_second()) + " calls/s, " + fmt(l.rows_per_call(), 3) + " rows a call, p50 " +
                        fmt(l.p50_ms(), 3) + " ms, p99 " + fmt(l.p99_ms(), 3) + " ms"});
  rows.push_back({"placement epoch", std::to_string(j.progress().epoch())});
  rows.push_back({"balancedness", j.progress().has_window_balancedness()
                                      ? fmt(j.progress().window_balancedness(), 3) + " (load window)"
                                      : "- (no call measured yet)"});
}

void result_rows(const v1::JobResult& j, Rows& rows) {
  rows.push_back({"steps", std::to_string(static_cast<int64_t>(j.steps_completed())) + "/" +
                               std::to_string(j.spec().steps())});
  rows.push_back({"tokens/s", rate_text(j.tokens_per_second())});
  rows.push_back({"step p50", human_seconds(j.step_seconds_p50())});
  if (j.phase_seconds().teacher() > 0 || j.phase_seconds().inputs() > 0)
    rows.push_back({"layer tokens/s", rate_text(j.layer_tokens_per_second()) + " (step " +
                                          human_seconds(j.layer_step_seconds_p50()) +
                                          " without the synthetic teacher and inputs)"});
  rows.push_back({"phases (ms)", phases_line(j.phase_seconds())});
  const double ratio = j.naive_dispatch_bytes() > 0 ? j.dispatch_bytes() / j.naive_dispatch_bytes() : 0;
  rows.push_back({"dispatch bytes", human_bytes(j.dispatch_bytes()) + " (" + fmt(100 * ratio, 3) + "% of naive)"});
  rows.push_back({"combine bytes", human_bytes(j.combine_bytes())});
  if (j.overlap_chunks() > 1)
    rows.push_back({"overlap", std::to_string(j.overlap_chunks()) + " chunks a dispatch/combine pair (last step)"});
  rows.push_back({"balancedness", fmt(j.balancedness(), 3)});
  for (const auto& [name, curve] : {std::pair{"loss", &j.loss()}, std::pair{"aux loss", &j.aux_loss()},
                                    std::pair{"z-loss", &j.z_loss()}})
    if (!curve->empty() && (curve->at(0) != 0 || curve->at(curve->size() - 1) != 0))
      rows.push_back({name, fmt(curve->at(0)) + " -> " + fmt(curve->at(curve->size() - 1)) + " (first and last step)"});
}

std::string verify_text(const v1::JobResult& j) {
  if (j.has_verify())
    return std::string(j.verify().passed() ? "passed" : "FAILED") + " (max abs " + fmt(j.verify().max_abs_error()) +
           ", max rel " + fmt(j.verify().max_rel_error()) + ")";
  if (j.state() == v1::JOB_STATE_QUEUED || j.state() == v1::JOB_STATE_RUNNING)
    return "at step " + std::to_string(j.spec().verify_step()) + ", when the job ends";
  return "not run (the job ended before step " + std::to_string(j.spec().verify_step()) + " was checked)";
}

// Each placement epoch the job ran under, after a live rebalance (more than one).
void print_epochs(std::ostream& out, const v1::JobResult& j) {
  if (j.epochs_size() < 2) return;
  std::vector<std::vector<std::string>> t = {
      {"EPOCH", "STEPS", "BALANCEDNESS", "EXPERT S (SLOWEST RANK)", "STEP P50", "FIRST STEP"}};
  for (const v1::EpochRun& e : j.epochs())
    t.push_back({std::to_string(e.epoch()),
                 std::to_string(e.first_step()) + "-" + std::to_string(e.first_step() + e.steps() - 1),
                 fmt(e.balancedness(), 3), fmt(e.slowest_rank_expert_seconds(), 3), human_seconds(e.step_seconds_p50()),
                 human_seconds(e.first_step_seconds())});
  out << "\n";
  print_table(out, t);
}

// An elastic job's changes of world (docs/jobs.md#elastic-jobs).
void print_world_changes(std::ostream& out, const v1::JobResult& j) {
  if (j.world_changes_size() == 0) return;
  std::vector<std::vector<std::string>> t = {
      {"WORLD", "AT STEP", "RANKS", "LOST", "JOINED", "DETECTION", "RECOVERY", "FROM REPLICAS", "FROM CHECKPOINT",
       "RECOMPUTED", "TOKENS/RANK", "CAUSE"}};
  auto names = [](const auto& list) {
    std::string s;
    for (const auto& n : list) s += (s.empty() ? "" : ",") + n;
    return s.empty() ? std::string("-") : s;
  };
  for (const v1::WorldChange& w : j.world_changes())
    t.push_back({std::to_string(w.world_epoch()), std::to_string(w.step()),
                 std::to_string(w.old_world()) + " -> " + std::to_string(w.new_world()), names(w.lost_nodes()),
                 names(w.joined_nodes()), human_seconds(w.detection_seconds()),
                 w.recovery_seconds() > 0 ? human_seconds(w.recovery_seconds()) : "-",
                 std::to_string(w.experts_from_replicas()), std::to_string(w.experts_from_checkpoint()),
                 std::to_string(w.steps_recomputed()), std::to_string(w.tokens_per_rank()), w.cause()});
  out << "\nworld changes\n";
  print_table(out, t);
}

}  // namespace

void print_job(std::ostream& out, const v1::JobResult& j) {
  Rows rows = {{"job", j.job_id()}};
  if (!j.spec().name().empty()) rows.push_back({"name", j.spec().name()});
  if (!j.spec().labels().empty()) {
    std::string labels;
    for (const auto& [k, v] : j.spec().labels()) labels += (labels.empty() ? "" : ",") + k + "=" + v;
    rows.push_back({"labels", labels});
  }
  rows.push_back({"state", state_name(j.state())});
  if (!j.message().empty()) rows.push_back({"message", j.message()});
  if (j.state() == v1::JOB_STATE_QUEUED) rows.push_back({"waiting for", j.progress().waiting_for()});
  rows.push_back({"submitted", local_time(j.submitted_unix_ms())});
  if (j.started_unix_ms() > 0)
    rows.push_back({"started", local_time(j.started_unix_ms()) + " (" +
                                   (j.state() == v1::JOB_STATE_RUNNING ? "running for " : "ran ") +
                                   human_seconds(duration_of(j)) + ")"});
  const bool serving = j.spec().mode() == v1::JobSpec::serve;
  if (j.state() == v1::JOB_STATE_RUNNING && serving) serving_rows(j, rows);
  else if (j.state() == v1::JOB_STATE_RUNNING) progress_rows(j, rows);
  else if (j.steps_completed() > 0 && !serving) result_rows(j, rows);
  if (!j.progress().rebalance().empty()) rows.push_back({"rebalance", j.progress().rebalance()});
  if (j.spec().verify()) rows.push_back({"verify", verify_text(j)});
  if (!j.placement().empty())  // docs/placement.md#cluster-state
    rows.push_back({j.started_unix_ms() > 0 ? "started on" : "would start on", j.placement()});
  if (j.state() != v1::JOB_STATE_RUNNING)
    rows.push_back({"placement epoch", std::to_string(static_cast<int64_t>(j.placement_epoch()))});
  print_rows(out, rows);
  print_epochs(out, j);
  print_world_changes(out, j);
}

std::string progress_line(const v1::JobResult& j) {
  const v1::JobProgress& p = j.progress();
  std::string s = j.job_id() + " " + state_name(j.state());
  if (j.state() == v1::JOB_STATE_QUEUED) return s + ": waiting for " + p.waiting_for();
  if (j.spec().mode() == v1::JobSpec::serve && j.state() == v1::JOB_STATE_RUNNING) {
    const v1::ServeProgress& v = p.serve();
    return s + "  clients " + std::to_string(v.clients()) + "  calls/s " + human_count(v.calls_per_second()) +
           "  tokens/s " + human_count(v.rows_per_second()) + "  queued " + std::to_string(v.queued_rows()) +
           (p.has_window_balancedness() ? "  balancedness " + fmt(p.window_balancedness(), 3) : "");
  }
  s += " step " + step_text(j);
  if (p.has_loss()) s += "  loss " + fmt(p.loss());
  if (p.recent_steps() > 0)
    s += "  tokens/s " + human_count(p.tokens_per_second()) + "  step " + human_seconds(p.step_seconds());
  if (j.state() == v1::JOB_STATE_RUNNING && p.has_eta_seconds()) s += "  eta " + human_seconds(p.eta_seconds());
  if (p.epoch() > 0) s += "  epoch " + std::to_string(p.epoch());
  if (p.has_window_balancedness()) s += "  balancedness " + fmt(p.window_balancedness(), 3);
  if (j.world_changes_size() > 0) {
    const v1::WorldChange& w = j.world_changes(j.world_changes_size() - 1);
    s += "  world " + std::to_string(w.world_epoch()) + " (" + std::to_string(w.new_world()) + " ranks)";
  }
  if (!j.message().empty()) s += ": " + j.message();
  return s;
}

std::string world_change_line(const v1::JobResult& j, const v1::WorldChange& w) {
  auto names = [](const auto& list) {
    std::string s;
    for (const auto& n : list) s += (s.empty() ? "" : ",") + n;
    return s;
  };
  std::string s = j.job_id() + " world " + std::to_string(w.world_epoch()) + " at step " + std::to_string(w.step()) + ":";
  if (w.lost_nodes_size() > 0) s += " lost " + names(w.lost_nodes());
  if (w.joined_nodes_size() > 0) s += std::string(w.lost_nodes_size() > 0 ? "," : "") + " " + names(w.joined_nodes()) + " joined";
  if (!w.cause().empty()) s += " (" + w.cause() + ")";
  s += "; " + std::to_string(w.old_world()) + " -> " + std::to_string(w.new_world()) + " ranks";
  if (w.experts_from_replicas() > 0) s += ", " + std::to_string(w.experts_from_replicas()) + " experts from replicas";
  if (w.experts_from_checkpoint() > 0) s += ", " + std::to_string(w.experts_from_checkpoint()) + " experts from " + w.checkpoint();
  if (w.steps_recomputed() > 0) s += ", " + std::to_string(w.steps_recomputed()) + " steps recomputed";
  return s;
}

void print_job_list(std::ostream& out, const std::vector<v1::JobResult>& jobs, int width) {
  bool names = false;
  for (const auto& j : jobs) names = names || !j.spec().name().empty();
  std::vector<std::vector<std::string>> rows;
  rows.push_back({"JOB", "NAME", "STATE", "MODE", "SUBMITTED", "DURATION", "STEP", "TOKENS/S", "REASON"});
  for (const v1::JobResult& j : jobs) {
    const bool running = j.state() == v1::JOB_STATE_RUNNING;
    const double tps = running ? j.progress().tokens_per_second() : j.tokens_per_second();
    std::string reason = j.message();
    if (j.state() == v1::JOB_STATE_QUEUED) reason = "waiting for " + j.progress().waiting_for();
    else if (running && !j.progress().rebalance().empty()) reason = j.progress().rebalance();
    rows.push_back({j.job_id(), j.spec().name(), state_name(j.state()), v1::JobSpec::Mode_Name(j.spec().mode()),
                    local_time(j.submitted_unix_ms()), duration_of(j) < 0 ? "-" : human_seconds(duration_of(j)),
                    step_text(j), tps > 0 ? human_count(tps) : "-", reason});
  }
  if (!names)
    for (auto& r : rows) r.erase(r.begin() + 1);
  // The reason takes what the other columns leave of the width.
  std::vector<size_t> w(rows[0].size(), 0);
  for (const auto& r : rows)
    for (size_t i = 0; i < r.size(); ++i) w[i] = std::max(w[i], r[i].size());
  size_t used = 0;
  for (size_t i = 0; i + 1 < w.size(); ++i) used += w[i] + 2;
  const size_t room = width > static_cast<int>(used) + 3 ? width - used : 3;  // "..." at least
  // A queued job's reason says what to do: cut in the table, it follows whole.
  std::vector<std::string> notes;
  for (size_t i = 1; i < rows.size(); ++i)
    if (jobs[i - 1].state() == v1::JOB_STATE_QUEUED && rows[i].back().size() > room)
      notes.push_back(jobs[i - 1].job_id() + " is " + rows[i].back());
  for (auto& r : rows) r.back() = cut(r.back(), room);
  print_table(out, rows);
  for (const std::string& n : notes) out << wrap(n, std::max(width, 40), 2);
}

}  // namespace moe::ctl
