#include "moe/node/job_runner.h"

#include "moe/base/log.h"
#include "moe/node/rank_run.h"
#include "moe/transport/communicator.h"

namespace moe::node {

JobRunner::JobRunner(v1::StartJob job, RunnerEnv env)
    : job_(std::move(job)), env_(std::move(env)), mailbox_(job_.job_id(), env_.devices) {
  reports_ = std::make_unique<ReportSender>(
      rpc::ClientOptions::make(env_.agent_address, env_.token, "moed", env_.node_name + "/reports", env_.tls), *env_.link,
      job_.job_id(), env_.devices);
  env_.reports = reports_.get();
  std::vector<int> local;
  for (int i = 0; i < env_.devices; ++i) local.push_back(env_.node_index * env_.devices + i);
  hub_ = std::make_shared<transport::LocalHub>(local);
  running_ = env_.devices;
  for (int i = 0; i < env_.devices; ++i) threads_.emplace_back([this, i] { rank_main(i); });
}

JobRunner::~JobRunner() {
  cancel("daemon stopping");
  for (auto& t : threads_) t.join();
  reports_->flush(std::chrono::steady_clock::now() + std::chrono::seconds(10));
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
  std::lock_guard<std::mutex> lock(cancel_mu_);
  if (cancel_.exchange(true)) return;
  cancel_reason_ = reason;
  log::info("job ", job_.job_id(), ": cancel requested (", reason, ")");
}

std::string JobRunner::cancel_reason() const {
  std::lock_guard<std::mutex> lock(cancel_mu_);
  return cancel_reason_.empty() ? "cancelled by another rank" : cancel_reason_;
}

void JobRunner::rank_main(int local) {
  const int rank = env_.node_index * env_.devices + local;
  rpc::RpcClient agent(rpc::ClientOptions::make(env_.agent_address, env_.token, "moed",
                                                env_.node_name + "/rank" + std::to_string(rank), env_.tls));
  v1::Envelope done;
  auto* d = done.mutable_rank_done();
  d->set_job_id(job_.job_id());
  d->set_rank(rank);
  try {
    RankRun run(job_, env_, rank, hub_, agent, mailbox_);
    {  // fail() aborts its device transport from now on (at once if it already ran)
      std::lock_guard<std::mutex> lock(cancel_mu_);
      live_ranks_[local] = &run;
      if (!failure_.empty()) run.abort_transport("job failed: " + failure_);
    }
    struct Unregister {
      JobRunner* self;
      int local;
      ~Unregister() {
        std::lock_guard<std::mutex> lock(self->cancel_mu_);
        self->live_ranks_.erase(local);
      }
    } unregister{this, local};
    const int steps = run.run([this] { return cancel_.load(); });
    if (steps < job_.spec().steps()) {
      d->set_ok(false);
      d->set_cancelled(true);
      d->set_cancel_requested_here(cancel_.load());
      d->set_agent_unreachable(agent_lost_.load());
      d->set_message("cancelled at step " + std::to_string(steps) + " (" + cancel_reason() + ")");
    } else {
      d->set_ok(true);
      if (job_.spec().verify()) *d->mutable_verify() = run.verification();
    }
  } catch (const transport::TransportError& e) {
    d->set_ok(false);
    d->set_message(e.what());
    d->set_failed_peer(e.peer());
    hub_->abort(rank, e.what(), e.peer());  // siblings waiting on us blame the same rank
  } catch (const std::exception& e) {
    d->set_ok(false);
    d->set_message(e.what());
    hub_->abort(rank, e.what());
  }
  if (!d->ok() && !d->cancelled()) log::warn("job ", job_.job_id(), ": rank ", rank, " failed: ", d->message());
  // Finished before the report: once the agent hears from every rank it may start
  // the next job here, and the daemon must not find this one still running.
  --running_;
  reports_->send(std::move(done));
}

}  // namespace moe::node
