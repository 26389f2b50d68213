#include "moe/node/rank_run.h"

#include <algorithm>
#include <cmath>

#include "moe/base/clock.h"
#include "moe/base/log.h"
#include "moe/node/checkpoint.h"
#include "moe/node/dump.h"
#include "moe/layer_spec/job_layers.h"
#include "moe/node/verify.h"
#include "moe/spec/checkpoint_manifest.h"
#include "moe/spec/expert_map_codec.h"

namespace moe::node {
namespace {

std::vector<moe::ExpertMap> expert_maps(const v1::StartJob& job) {
  std::vector<moe::ExpertMap> maps;
  for (const auto& m : job.maps()) maps.push_back(spec::from_proto(m));
  return maps;
}

// The memory the rank's backend computes in: the transport factory gives a CUDA
// job's ranks a communicator for it (NCCL) beside the host one.
transport::DataMemory data_memory(const kernels::Backend& be) {
  return be.name() == "cuda" ? transport::DataMemory::kCuda : transport::DataMemory::kHost;
}

}  // namespace

std::vector<std::string> AgentBootstrap::all_gather(const std::string& mine) {
  v1::Envelope req;
  auto* p = req.mutable_bootstrap_publish();
  p->set_job_id(job_id_);
  p->set_rank(rank_);
  p->set_blob(mine);
  try {
    const v1::Envelope reply = agent_.call(req, std::chrono::seconds(60));
    return {reply.bootstrap_addresses().blobs().begin(), reply.bootstrap_addresses().blobs().end()};
  } catch (const rpc::RpcError& e) {
    throw rpc::RpcError(e.code(), std::string("transport bootstrap through the agent: ") + e.what());
  }
}

RankRun::RankRun(const v1::StartJob& job, const RunnerEnv& env, int rank, std::shared_ptr<transport::LocalHub> hub,
                 rpc::RpcClient& agent, RebalanceMailbox& mailbox)
    : job_(job),
      spec_(job.spec()),
      env_(env),
      rank_(rank),
      local_(rank - env.node_index * env.devices),
      pool_(env.threads_per_rank),
      backend_(env.make_backend(pool_, local_)),
      boot_(agent, job.job_id(), rank),
      transports_(transport::make_rank_transports({.rank = rank,
                                                   .world = job.world_size(),
                                                   .local = std::move(hub),
                                                   .bootstrap = &boot_,
                                                   .data_memory = data_memory(*backend_),
                                                   .device = local_,
                                                   .connect_timeout = env.transport_timeout,
                                                   .job_key = job.data_plane_key()})),
      comm_(*transports_.host),
      stack_(spec_, expert_maps(job), rank, job.world_size(), comm_, *backend_, pool_, env.transport_timeout,
             transports_.data.get()),
      rebalance_({.job_id = job.job_id(),
                  .node_name = env.node_name,
                  .rank = rank,
                  .world = job.world_size(),
                  .faults = env.faults,
                  .metrics = env.metrics},
                 stack_, mailbox, agent) {
  verify_.set_passed(true);
  if (!spec_.resume().empty()) {  // the agent resolved and checked the folder
    const v1::CheckpointManifest m = spec::read_manifest(spec_.resume());
    load_checkpoint(spec_.resume(), m, stack_, rank_);
    first_step_ = m.step();
    log::info("job ", job_.job_id(), ": rank ", rank_, " resumed from ", spec_.resume(), " at step ", first_step_);
  }
  log::info("job ", job_.job_id(), ": rank ", rank_, " of ", job.world_size(), " ready (", spec_.layers(),
            " layers, ", spec_.tokens_per_rank(), " tokens, ", v1::JobSpec::Mode_Name(spec_.mode()), ", ",
            backend_->name(), " backend on device ", local_, ", ", comm_.name(),
            transports_.data ? ", " + transports_.data->name() + " for its memory" : "",
            ")");
}

void RankRun::abort_transport(const std::string& why) {
  if (transports_.data) transports_.data->abort(why);
  comm_.abort(why);
}

bool RankRun::agree_and_act(bool cancel_requested, int step) {
  float vote[1 + RebalanceSession::kVoteFloats] = {cancel_requested ? 1.0f : 0.0f};
  rebalance_.vote(vote + 1);
  comm_.all_reduce_sum(vote, std::size(vote), deadline());
  if (vote[0] > 0) return true;
  rebalance_.act(vote + 1, step);
  return false;
}

// What this rank saw of its train step that is not finite: its share of the
// loss, the balancing losses, or a router gradient (summed over every rank, so a
// non-finite value in any rank's backward shows there); "" when all are finite.
std::string RankRun::nonfinite(const StepReport& report) const {
  const v1::StepStats& s = report.stats();
  if (!std::isfinite(s.loss())) return "the loss is " + std::to_string(s.loss());
  if (!std::isfinite(s.aux_loss()) || !std::isfinite(s.z_loss()))
    return "the balancing losses are " + std::to_string(s.aux_loss()) + ", " + std::to_string(s.z_loss());
  if (const int l = stack_.first_nonfinite_router_gradient(); l >= 0)
    return "layer " + std::to_string(l) + "'s router gradient is not finite";
  return "";
}

// Collective, after a train step: every rank learns whether any rank's step was
// not finite, and then every rank fails the job with the same message naming the
// step and the ranks, before a checkpoint or the next step uses the state.
void RankRun::agree_finite(int step, const std::string& what) {
  float any = what.empty() ? 0.0f : 1.0f;
  comm_.all_reduce_sum(&any, 1, deadline());
  if (any == 0.0f) return;
  std::vector<float> ranks(job_.world_size(), 0.0f);
  ranks[rank_] = what.empty() ? 0.0f : 1.0f;
  comm_.all_reduce_sum(ranks.data(), ranks.size(), deadline());
  std::string which;
  for (size_t r = 0; r < ranks.size(); ++r)
    if (ranks[r] > 0) which += (which.empty() ? "" : ", ") + std::to_string(r);
  MOE_CHECK(false, "step ", step, ": not finite on rank(s) ", which, what.empty() ? "" : " (here: " + what + ")");
}

void RankRun::run_step(int step) {
  // A resumed run covers its first step when asked for an earlier one.
  const bool verify = spec_.verify() && step == std::max(spec_.verify_step(), first_step_);
  const bool dump = !spec_.dump_dir().empty() && step == std::max(spec_.dump_step(), first_step_);
  const bool covered = verify || dump;
  const bool train = spec_.mode() == v1::JobSpec::train;
  StepReport report(step, spec_.experts());
  const double t0 = now_seconds();
  stack_.forward(step, report, covered);
  // The weights this step uses, before its optimizer step changes them.
  std::vector<model::LayerWeights> weights;
  if (covered) weights = stack_.weights_in_use(step, deadline());
  if (train) {
    stack_.backward(report, covered);
    stack_.optimize(step, report);
  }
  stack_.update_selection_bias();
  report.set_step_seconds(now_seconds() - t0);
  report.record(env_.metrics, rank_);
  v1::Envelope msg;
  auto* r = msg.mutable_step_report();
  r->set_job_id(job_.job_id());
  r->set_rank(rank_);
  *r->mutable_stats() = report.stats();
  env_.reports->send(std::move(msg));  // held while the agent is away
  if (train) agree_finite(step, nonfinite(report));
  // The covered step's snapshots, gradients (the optimizer leaves them) and
  // weights are what verify and the dump need.
  if (verify) verify_ = verify_step(spec_, stack_, weights, rank_, comm_, deadline());
  if (dump) dump_step(spec_, stack_, weights[0], rank_);
}

// A checkpoint after `done` steps: every checkpoint_every steps and at the end.
bool RankRun::checkpoint_due(int done) const {
  if (spec_.checkpoint_dir().empty()) return false;
  const int every = spec_.checkpoint_every();
  return done == spec_.steps() || (every > 0 && done % every == 0);
}

int RankRun::run(const std::function<bool()>& cancel_requested) {
  int step = first_step_;
  for (; step < spec_.steps(); ++step) {
    if (agree_and_act(cancel_requested(), step)) break;
    run_step(step);
    rebalance_.after_step();
    if (checkpoint_due(step + 1)) write_checkpoint(job_, stack_, step + 1, rank_, comm_, deadline());
  }
  comm_.barrier(deadline());  // nobody tears down endpoints a peer still uses
  return step;
}

}  // namespace moe::node
