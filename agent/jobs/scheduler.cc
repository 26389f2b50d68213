#include "moe/jobs/scheduler.h"

#include "moe/rpc/frame.h"

namespace moe::agent {

Scheduler::Scheduler(SchedulerOptions options, Membership& members, PlacementService& placement,
                     SchedulerActions& actions)
    : opts_(options),
      members_(members),
      placement_(placement),
      actions_(actions),
      book_(opts_.heartbeat_interval, members),
      run_(opts_, members, placement, actions, book_),
      worlds_(opts_, members, placement, actions, book_, run_) {}

const v1::JobResult& Scheduler::submit(v1::JobSpec spec) {
  v1::JobResult& rec = book_.submit(std::move(spec));
  const v1::JobSpec& s = rec.spec();
  const ShapeKey shape{s.experts(), s.layers(), members_.num_nodes(), members_.devices_per_node()};
  // Said at submit; a resumed job starts on its checkpoint's maps instead.
  if (s.resume().empty() && placement_.carries_state(shape)) rec.set_placement(placement_.summary(shape));
  return rec;
}

const v1::JobResult& Scheduler::cancel(const std::string& id, Clock::time_point now) {
  v1::JobResult& rec = book_.at(id);
  const v1::JobState st = rec.state();
  if (st == v1::JOB_STATE_SUCCEEDED || st == v1::JOB_STATE_FAILED || st == v1::JOB_STATE_CANCELLED) {
    const std::string name = v1::JobState_Name(st);
    throw rpc::RpcError(v1::ERROR_CODE_FAILED_PRECONDITION,
                        id + " already ended (" + name.substr(name.rfind('_') + 1) + "): nothing to cancel");
  }
  if (book_.cancel_queued(id))
    actions_.job_ended(rec);
  else if (rec.state() == v1::JOB_STATE_RUNNING && running_id() == id)
    run_.cancel(now);
  return rec;
}

void Scheduler::try_start(Clock::time_point now) {
  while (!run_.running() && book_.queued() > 0 && members_.ready_for_job())
    if (run_.start(book_.at(*book_.take_next()), now)) return;
}

void Scheduler::on_step(const v1::StepReport& r, Clock::time_point now) {
  const std::optional<int> step = run_.on_step(r, now);
  if (!step) return;
  worlds_.on_step_complete(now);
  actions_.step_completed(r.job_id(), *step);
}

void Scheduler::on_node_dead(const std::string& why, Clock::time_point now, int node) {
  if (!run_.running()) return;
  if (node >= 0 && run_.elastic_running()) return worlds_.node_lost(node, "node_dead", why, now);
  run_.on_node_dead(why, now);
}

void Scheduler::tick(Clock::time_point now) {
  if (!run_.running() || worlds_.tick(now)) return;
  run_.tick(now);
}

}  // namespace moe::agent
