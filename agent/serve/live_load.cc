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

// The running job: its pace over the last complete steps (the scheduler's JobProgress).
v1::LiveJob running_job(const Scheduler& s, const RunningJob& run) {
  v1::LiveJob j;
  const v1::JobResult& rec = s.record(run.id);
  fill_spec(rec, j);
  if (run.recent_step_seconds.empty()) return j;  // none yet, or none since the agent restarted
  j.set_recent_steps(rec.progress().recent_steps());
  j.set_step_seconds(rec.progress().step_seconds());
  j.set_tokens_per_second(rec.progress().tokens_per_second());
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
