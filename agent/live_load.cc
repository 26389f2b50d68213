#include "moe/agent/live_load.h"

#include <algorithm>
#include <cctype>
#include <vector>

namespace moe::agent {
namespace {

// JOB_STATE_SUCCEEDED -> "succeeded", the label values of moe_jobs.
std::string state_key(v1::JobState s) {
  std::string k = v1::JobState_Name(s).substr(10);
  std::transform(k.begin(), k.end(), k.begin(), [](unsigned char c) { return std::tolower(c); });
  return k;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void fill_spec(const v1::JobResult& rec, v1::LiveJob& j) {
  j.set_job_id(rec.job_id());
  j.set_state(rec.state());
  j.set_steps_completed(static_cast<int32_t>(rec.steps_completed()));
  j.set_steps(rec.spec().steps());
  j.set_mode(rec.spec().mode());
  j.set_dtype(rec.spec().dtype());
  j.set_top_k(rec.spec().top_k());
  j.set_message(rec.message());
  if (rec.progress().has_loss()) j.set_loss(rec.progress().loss());
  if (rec.state() == v1::JOB_STATE_RUNNING && rec.progress().has_eta_seconds())
    j.set_eta_seconds(rec.progress().eta_seconds());
}

// The running job: its step time over the last complete steps.
v1::LiveJob running_job(const Scheduler& s, const RunningJob& run) {
  v1::LiveJob j;
  fill_spec(s.record(run.id), j);
  const std::vector<double> recent(run.recent_step_seconds.begin(), run.recent_step_seconds.end());
  const double step = median(recent);
  j.set_recent_steps(static_cast<int32_t>(recent.size()));
  j.set_step_seconds(step);
  const double tokens = static_cast<double>(run.reports.spec.tokens_per_rank()) * run.reports.world;
  j.set_tokens_per_second(step > 0 ? tokens / step : 0.0);
  return j;
}

// The job that ended last (null if none did).
const v1::JobResult* last_ended(const Scheduler& s) {
  const v1::JobResult* last = nullptr;
  for (const auto& [id, rec] : s.jobs())
    if (Scheduler::finished(rec.state()) && (!last || rec.finished_unix_ms() >= last->finished_unix_ms())) last = &rec;
  return last;
}

}  // namespace

v1::LiveLoad live_load(const Membership& members, const Scheduler& scheduler, const PlacementService& placement,
                       int window_capacity) {
  v1::LiveLoad out;
  out.set_nodes(members.num_nodes());
  out.set_nodes_alive(members.counts().at(v1::NODE_STATE_ALIVE));
  out.set_world_size(members.world_size());
  out.set_alive_ranks(members.alive_ranks());
  out.set_window_capacity(window_capacity);
  for (const auto& [state, n] : scheduler.counts()) (*out.mutable_jobs())[state_key(state)] = n;
  v1::PlacementReply p = placement.describe({}, std::nullopt);  // empty before any job
  *out.mutable_shape() = p.shape();
  *out.mutable_layers() = std::move(*p.mutable_layers());
  if (const RunningJob* run = scheduler.running()) {
    *out.mutable_job() = running_job(scheduler, *run);
  } else if (const v1::JobResult* rec = last_ended(scheduler)) {
    fill_spec(*rec, *out.mutable_job());
    out.mutable_job()->set_step_seconds(rec->step_seconds_p50());
    out.mutable_job()->set_tokens_per_second(rec->tokens_per_second());
  }
  return out;
}

}  // namespace moe::agent
