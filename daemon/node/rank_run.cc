#include "moe/node/rank_run.h"

#include "moe/base/clock.h"
#include "moe/base/log.h"
#include "moe/node/dump.h"
#include "moe/node/job_model.h"
#include "moe/node/verify.h"

namespace moe::node {
namespace {

std::vector<ep::ExpertMap> expert_maps(const v1::StartJob& job) {
  std::vector<ep::ExpertMap> maps;
  for (const auto& m : job.maps()) maps.push_back(expert_map(m));
  return maps;
}

transport::UcxOptions ucx_options(std::shared_ptr<transport::LocalHub> hub) {
  transport::UcxOptions o;
  o.hub = std::move(hub);
  return o;
}

}  // namespace

std::vector<std::string> AgentBootstrap::all_gather(const std::string& mine) {
  v1::Envelope req;
  auto* p = req.mutable_bootstrap_publish();
  p->set_job_id(job_id_);
  p->set_rank(rank_);
  p->set_blob(mine);
  const v1::Envelope reply = agent_.call(req, std::chrono::seconds(60));
  return {reply.bootstrap_addresses().blobs().begin(), reply.bootstrap_addresses().blobs().end()};
}

RankRun::RankRun(const v1::StartJob& job, const RunnerEnv& env, int rank, std::shared_ptr<transport::LocalHub> hub,
                 rpc::RpcClient& agent)
    : job_(job),
      spec_(job.spec()),
      env_(env),
      rank_(rank),
      pool_(env.threads_per_rank),
      backend_(env.make_backend(pool_)),
      boot_(agent, job.job_id(), rank),
      comm_(rank, job.world_size(), boot_, ucx_options(std::move(hub))),
      agent_(agent),
      stack_(spec_, expert_maps(job), rank, job.world_size(), comm_, *backend_, env.transport_timeout) {
  verify_.set_passed(true);
  log::info("job ", job_.job_id(), ": rank ", rank_, " of ", job.world_size(), " ready (", spec_.layers(),
            " layers, ", spec_.tokens_per_rank(), " tokens, ", v1::JobSpec::Mode_Name(spec_.mode()), ", ",
            backend_->name(), " backend)");
}

bool RankRun::agree_to_stop(bool requested) {
  float stop = requested ? 1.0f : 0.0f;
  comm_.all_reduce_sum(&stop, 1, deadline());
  return stop > 0;
}

void RankRun::run_step(int step) {
  const bool covered = step == 0;  // the step verify and the dump cover
  const bool train = spec_.mode() == v1::JobSpec::train;
  StepReport report(step, spec_.experts());
  const double t0 = now_seconds();
  stack_.forward(step, report, covered);
  if (train) {
    stack_.backward(report, covered);
    stack_.optimize(step, report);
  }
  report.set_step_seconds(now_seconds() - t0);
  report.record(env_.metrics, rank_);
  v1::Envelope msg;
  auto* r = msg.mutable_step_report();
  r->set_job_id(job_.job_id());
  r->set_rank(rank_);
  *r->mutable_stats() = report.stats();
  agent_.call(msg, std::chrono::seconds(10));
  // The covered step's snapshots, gradients (the optimizer leaves them) and
  // initial weights (rebuilt from the spec) are what verify and the dump need.
  if (!covered) return;
  if (spec_.verify()) verify_ = verify_step(spec_, stack_, rank_, comm_, deadline());
  if (!spec_.dump_dir().empty()) dump_step(spec_, stack_, rank_);
}

int RankRun::run(const std::function<bool()>& cancel_requested) {
  int step = 0;
  for (; step < spec_.steps(); ++step) {
    if (agree_to_stop(cancel_requested())) break;
    run_step(step);
  }
  comm_.barrier(deadline());  // nobody tears down endpoints a peer still uses
  return step;
}

}  // namespace moe::node
