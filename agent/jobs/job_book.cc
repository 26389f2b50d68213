#include "moe/jobs/job_book.h"

#include <algorithm>
#include <cstdlib>

#include "moe/base/check.h"
#include "moe/base/clock.h"
#include "moe/base/log.h"
#include "moe/rpc/frame.h"
#include "moe/spec/checkpoint_manifest.h"
#include "moe/spec/job_spec.h"
#include "moe/spec/weights_check.h"

namespace moe::agent {
namespace {

int64_t job_number(const std::string& id) {
  return id.rfind("job-", 0) == 0 ? std::strtoll(id.c_str() + 4, nullptr, 10) : 0;
}

// The rules of a spec that depend on the cluster (spec::validate checks the rest).
void check_against_cluster(const v1::JobSpec& spec, const Membership& members,
                           std::chrono::milliseconds heartbeat_interval) {
  if (spec.dead_node_timeout_ms() > 0 && spec.dead_node_timeout_ms() < 4 * heartbeat_interval.count())
    throw moe::InvalidArgument("dead_node_timeout_ms: at least 4 heartbeat intervals (" +
                               std::to_string(4 * heartbeat_interval.count()) + " ms), got " +
                               std::to_string(spec.dead_node_timeout_ms()));
  if (spec.min_node_replicas() > std::max(1, members.num_nodes()))
    throw moe::InvalidArgument("min_node_replicas: the job asks for every expert on " +
                               std::to_string(spec.min_node_replicas()) + " nodes; the cluster has " +
                               std::to_string(members.num_nodes()));
  if (spec.elastic() && spec.elastic_batch() == v1::JobSpec::global) {  // every world it may shrink to divides the batch
    const int D = members.devices_per_node();
    const int64_t global = static_cast<int64_t>(spec.tokens_per_rank()) * members.world_size();
    for (int n = members.num_nodes() - 1; n >= 1; --n)
      if (global % (static_cast<int64_t>(n) * D) != 0)
        throw moe::InvalidArgument("elastic_batch: global keeps the " + std::to_string(global) +
                                   " tokens of a step, which do not divide over the " + std::to_string(n * D) +
                                   " ranks of " + std::to_string(n) +
                                   " surviving node(s); give another --tokens-per-rank, or --elastic-batch per_rank");
  }
  spec::check_weights(spec);  // refused now, not as a failed job later: the file holds the layers asked for
  if (!spec.resume().empty()) {  // refused now, not as a failed job later: the checkpoint exists and fits
    try {
      std::string folder;
      spec::load_for_resume(spec, folder);
    } catch (const moe::InvalidArgument&) {
      throw;
    } catch (const moe::Error& e) {
      throw moe::InvalidArgument(e.what());
    }
  }
}

}  // namespace

JobBook::JobBook(std::chrono::milliseconds heartbeat_interval, const Membership& members)
    : heartbeat_interval_(heartbeat_interval), members_(members) {}

bool JobBook::finished(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED || s == v1::JOB_STATE_CANCELLED;
}

v1::JobResult& JobBook::submit(v1::JobSpec spec) {
  spec = spec::with_defaults(std::move(spec));
  spec::validate(spec, members_.world_size());
  check_against_cluster(spec, members_, heartbeat_interval_);
  const std::string id = "job-" + std::to_string(next_job_++);
  v1::JobResult& rec = jobs_[id];
  rec.set_job_id(id);
  rec.set_state(v1::JOB_STATE_QUEUED);
  *rec.mutable_spec() = spec;
  rec.set_submitted_unix_ms(unix_ms());
  queue_.push_back(id);
  log::info("job ", id, " queued (", spec.experts(), " experts, top-", spec.top_k(), ", ", spec.layers(), " layers, ",
            spec.steps(), " steps)");
  return rec;
}

const v1::JobResult& JobBook::record(const std::string& id) const {
  const auto it = jobs_.find(id);
  if (it == jobs_.end()) throw rpc::RpcError(v1::ERROR_CODE_NOT_FOUND, "no job '" + id + "'");
  return it->second;
}

v1::JobResult& JobBook::at(const std::string& id) { return const_cast<v1::JobResult&>(record(id)); }

v1::JobResult JobBook::view(const std::string& id, const std::string& running_id) const {
  v1::JobResult rec = record(id);
  if (rec.state() == v1::JOB_STATE_QUEUED) rec.mutable_progress()->set_waiting_for(waiting_for(id, running_id));
  return rec;
}

std::vector<v1::JobResult> JobBook::list(const std::string& running_id) const {
  std::vector<v1::JobResult> out;
  for (const auto& [id, rec] : jobs_) out.push_back(view(id, running_id));
  std::stable_sort(out.begin(), out.end(), [](const v1::JobResult& a, const v1::JobResult& b) {
    return job_number(a.job_id()) < job_number(b.job_id());
  });
  return out;
}

// What a queued job waits for: the running job, the jobs ahead of it, or the
// nodes (docs/jobs.md#progress).
std::string JobBook::waiting_for(const std::string& id, const std::string& running_id) const {
  const auto pos = std::find(queue_.begin(), queue_.end(), id);
  if (!running_id.empty()) return running_id + " to end (one job runs at a time)";
  if (pos != queue_.begin() && pos != queue_.end())
    return std::to_string(pos - queue_.begin()) + " job(s) ahead of it, first " + queue_.front();
  const std::string nodes = members_.not_ready_reason();
  return nodes.empty() ? "its start" : nodes;
}

void JobBook::note_rebalance(const std::string& job_id, const std::string& why) {
  const auto it = jobs_.find(job_id);
  if (it != jobs_.end()) it->second.mutable_progress()->set_rebalance(why);
}

std::map<v1::JobState, int> JobBook::counts() const {
  std::map<v1::JobState, int> c;
  for (int s = v1::JOB_STATE_QUEUED; s <= v1::JOB_STATE_CANCELLED; ++s) c[static_cast<v1::JobState>(s)] = 0;
  for (const auto& [id, j] : jobs_) ++c[j.state()];
  return c;
}

std::optional<std::string> JobBook::take_next() {
  if (queue_.empty()) return std::nullopt;
  std::string id = queue_.front();
  queue_.pop_front();
  return id;
}

bool JobBook::cancel_queued(const std::string& id) {
  v1::JobResult& rec = at(id);
  if (rec.state() != v1::JOB_STATE_QUEUED) return false;
  queue_.erase(std::remove(queue_.begin(), queue_.end(), id), queue_.end());
  rec.set_state(v1::JOB_STATE_CANCELLED);
  rec.set_message("cancelled before it started");
  rec.set_finished_unix_ms(unix_ms());
  return true;
}

void JobBook::save(v1::SchedulerState& s) const {
  for (const auto& [id, rec] : jobs_) *s.add_jobs() = rec;
  for (const std::string& id : queue_) s.add_queue(id);
  s.set_next_job(next_job_);
}

void JobBook::restore(std::map<std::string, v1::JobResult> jobs, const v1::SchedulerState& s) {
  jobs_ = std::move(jobs);
  queue_.assign(s.queue().begin(), s.queue().end());
  next_job_ = s.next_job();
}

}  // namespace moe::agent
