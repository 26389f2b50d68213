#include "moe/node/job_runner.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "moe/base/log.h"
#include "moe/kernels/types.h"
#include "moe/rpc/frame.h"
#include "moe/layer_spec/job_layers.h"
#include "moe/node/rank_run.h"
#include "moe/transport/communicator.h"

namespace moe::node {
namespace {

std::vector<int> node_ranks(int first, int count) {
  std::vector<int> ranks;
  for (int i = 0; i < count; ++i) ranks.push_back(first + i);
  return ranks;
}

}  // namespace

JobRunner::JobRunner(v1::StartJob job, RunnerEnv env)
    : job_(std::move(job)),
      env_(std::move(env)),
      mailbox_(job_.job_id(), env_.devices),
      worlds_(job_.job_id(), job_.world_epoch(), node_ranks(first_rank(), env_.devices),
              [this](const std::string& why) { cancel(why); }) {
  reports_ = std::make_unique<ReportSender>(
      rpc::ClientOptions::make(env_.agent_address, env_.token, "moed", env_.node_name + "/reports", env_.tls), *env_.link,
      job_.job_id(), env_.devices);
  env_.reports = reports_.get();
  if (const layer_spec::JobView view(job_.spec()); view.serve) serve_ = std::make_unique<ServingNode>(view, env_.devices);
  running_ = env_.devices;
  for (int i = 0; i < env_.devices; ++i) threads_.emplace_back([this, i] { rank_main(i); });
}

// A running job is being stopped with the daemon: the stop grace bounds the wait
// for the step boundary; what is left of it, and at least a second, goes to
// delivering the ranks' reports. A finished job's runner (replaced by the next
// job's) cancels nothing.
JobRunner::~JobRunner() {
  if (!finished()) cancel("daemon stopping");
  const auto until = std::chrono::steady_clock::now() + env_.stop_grace;
  while (!finished() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling the ranks' count
  if (!finished()) {
    const std::string why = "daemon stopping: the job reached no step boundary within " +
                            std::to_string(env_.stop_grace.count()) + " ms";
    log::warn("job ", job_.job_id(), ": ", why, "; aborting its transfers");
    std::lock_guard<std::mutex> lock(cancel_mu_);
    stop_abort_ = why;
    for (auto& [local, run] : live_ranks_) run->abort_transport(why);
  }
  for (auto& t : threads_) t.join();
  if (serve_) serve_->close("job " + job_.job_id() + " ended on this node");
  reports_->flush(std::max(until, std::chrono::steady_clock::now() + std::chrono::seconds(1)));
}

void JobRunner::stop_for_agent(const std::string& reason) {
  agent_lost_ = true;
  cancel(reason);
}

void JobRunner::fail(const std::string& reason) {
  cancel(reason);
  std::lock_guard<std::mutex> lock(cancel_mu_);
  if (!failure_.empty()) return;
  failure_ = reason;
  for (auto& [local, run] : live_ranks_) run->abort_transport("job failed: " + reason);
}

void JobRunner::cancel(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(cancel_mu_);
    if (cancel_.exchange(true)) return;
    cancel_reason_ = reason;
    log::info("job ", job_.job_id(), ": cancel requested (", reason, ")");
  }
  worlds_.close();  // ranks waiting for a new world stop
  if (serve_) serve_->close("job " + job_.job_id() + " stopped: " + reason);
}

void JobRunner::halt(int64_t epoch, const std::string& reason) {
  log::warn("job ", job_.job_id(), ": the agent halts world ", epoch, ": ", reason);
  worlds_.halt(epoch);
  std::lock_guard<std::mutex> lock(cancel_mu_);
  for (auto& [local, run] : live_ranks_) run->abort_transport("world " + std::to_string(epoch) + " halted: " + reason, epoch);
}

void JobRunner::new_world(const v1::NewWorld& next) {
  worlds_.post(next);
  mailbox_.abandon("the job moves to world " + std::to_string(next.world_epoch()));  // its ranks are gone
}

std::string JobRunner::cancel_reason() const {
  std::lock_guard<std::mutex> lock(cancel_mu_);
  return cancel_reason_.empty() ? "cancelled by another rank" : cancel_reason_;
}

int JobRunner::first_rank() const {
  if (!job_.has_join()) return env_.node_index * env_.devices;
  const auto& nodes = job_.join().nodes();
  const auto at = std::find(nodes.begin(), nodes.end(), env_.node_name);
  MOE_CHECK(at != nodes.end(), "job ", job_.job_id(), ": world ", job_.join().world_epoch(), " has no node ",
            env_.node_name);
  return static_cast<int>(at - nodes.begin()) * env_.devices;
}

void JobRunner::rank_main(int local) {
  int rank = first_rank() + local;
  rpc::RpcClient agent(rpc::ClientOptions::make(env_.agent_address, env_.token, "moed",
                                                env_.node_name + "/rank" + std::to_string(rank), env_.tls));
  v1::Envelope done;
  auto* d = done.mutable_rank_done();
  d->set_job_id(job_.job_id());
  int64_t epoch = job_.world_epoch();
  const layer_spec::JobView view(job_.spec());
  try {
    RankRun run(job_, env_, rank, local, *this, agent);
    {  // fail() aborts its device transport from now on (at once if it already ran)
      std::lock_guard<std::mutex> lock(cancel_mu_);
      live_ranks_[local] = &run;
      if (!failure_.empty()) run.abort_transport("job failed: " + failure_);
      if (!stop_abort_.empty()) run.abort_transport(stop_abort_);
      if (worlds_.halted_epoch() >= run.world_epoch()) run.abort_transport("world halted", run.world_epoch());
    }
    struct Unregister {
      JobRunner* self;
      int local;
      ~Unregister() {
        std::lock_guard<std::mutex> lock(self->cancel_mu_);
        self->live_ranks_.erase(local);
      }
    } unregister{this, local};
    int steps = 0;
    try {
      steps = run.run([this] { return cancel_.load(); });
    } catch (...) {
      rank = run.rank();  // an elastic job's rank may have moved to another world
      epoch = run.world_epoch();
      throw;
    }
    rank = run.rank();
    epoch = run.world_epoch();
    if (view.serve || steps < view.steps) {  // a serving job only ever ends by a cancel
      d->set_ok(false);
      d->set_cancelled(true);
      d->set_cancel_requested_here(cancel_.load());
      d->set_agent_unreachable(agent_lost_.load());
      d->set_message((view.serve ? std::string("serving stopped") : "cancelled at step " + std::to_string(steps)) +
                     " (" + cancel_reason() + ")");
    } else {
      d->set_ok(true);
      if (view.verify) *d->mutable_verify() = run.verification();
    }
  } catch (const transport::TransportError& e) {
    d->set_ok(false);
    d->set_message(e.what());
    d->set_failed_peer(e.peer());
    worlds_.hub(epoch)->abort(rank, e.what(), e.peer());  // siblings waiting on us blame the same rank
  } catch (const std::exception& e) {
    d->set_ok(false);
    d->set_message(e.what());
    worlds_.hub(epoch)->abort(rank, e.what());
  }
  d->set_rank(rank);
  d->set_world_epoch(epoch);
  d->set_node_rank(env_.node_index * env_.devices + local);
  if (!d->ok() && !d->cancelled()) log::warn("job ", job_.job_id(), ": rank ", rank, " failed: ", d->message());
  if (serve_ && !d->ok() && !d->cancelled()) serve_->close("job " + job_.job_id() + ": rank " + std::to_string(rank) +
                                                           " failed: " + d->message());
  // Finished before the report: once the agent hears from every rank it may start
  // the next job here, and the daemon must not find this one still running.
  --running_;
  reports_->send(std::move(done));
}

}  // namespace moe::node
