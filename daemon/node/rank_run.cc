#include "moe/node/rank_run.h"

#include <algorithm>

#include "moe/base/clock.h"
#include "moe/base/log.h"
#include "moe/node/checkpoint.h"
#include "moe/node/dump.h"
#include "moe/node/job_model.h"
#include "moe/node/verify.h"
#include "moe/spec/checkpoint_manifest.h"
#ifdef MOE_WITH_CUDA
#include "moe/transport/nccl_communicator.h"
#endif

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

bool is_cuda(const kernels::Backend& be) { return be.name() == "cuda"; }

// A CUDA job's NCCL unique id, made by rank 0 (relayed with the UCX addresses).
std::string nccl_id_on_root(const kernels::Backend& be, int rank) {
#ifdef MOE_WITH_CUDA
  if (is_cuda(be) && rank == 0) return transport::NcclCommunicator::make_unique_id();
#endif
  return {};
}

// The communicator for the backend's memory: NCCL on the rank's GPU in a CUDA
// job; null (the UCX one carries everything) in a CPU job.
std::unique_ptr<transport::Communicator> make_data_comm(const kernels::Backend& be, int rank, int world, int device,
                                                        const std::string& nccl_id, transport::Deadline deadline) {
  if (!is_cuda(be)) return nullptr;
#ifdef MOE_WITH_CUDA
  return std::make_unique<transport::NcclCommunicator>(rank, world, device, nccl_id, deadline);
#else
  (void)rank, (void)world, (void)device, (void)nccl_id, (void)deadline;
  MOE_CHECK(false, "a CUDA backend in a build without CUDA");
  return nullptr;
#endif
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
                 rpc::RpcClient& agent, RebalanceMailbox& mailbox)
    : job_(job),
      spec_(job.spec()),
      env_(env),
      rank_(rank),
      local_(rank - env.node_index * env.devices),
      pool_(env.threads_per_rank),
      backend_(env.make_backend(pool_, local_)),
      boot_(agent, job.job_id(), rank),
      root_boot_(boot_, rank, nccl_id_on_root(*backend_, rank)),
      comm_(rank, job.world_size(), root_boot_, ucx_options(std::move(hub))),
      data_comm_(make_data_comm(*backend_, rank, job.world_size(), local_, root_boot_.root_blob(),
                                transport::deadline_in(env.transport_timeout))),
      agent_(agent),
      stack_(spec_, expert_maps(job), rank, job.world_size(), comm_, *backend_, pool_, env.transport_timeout,
             data_comm_.get()),
      mailbox_(mailbox) {
  verify_.set_passed(true);
  if (!spec_.resume().empty()) {  // the agent resolved and checked the folder
    const v1::CheckpointManifest m = spec::read_manifest(spec_.resume());
    load_checkpoint(spec_.resume(), m, stack_, rank_);
    first_step_ = m.step();
    log::info("job ", job_.job_id(), ": rank ", rank_, " resumed from ", spec_.resume(), " at step ", first_step_);
  }
  log::info("job ", job_.job_id(), ": rank ", rank_, " of ", job.world_size(), " ready (", spec_.layers(),
            " layers, ", spec_.tokens_per_rank(), " tokens, ", v1::JobSpec::Mode_Name(spec_.mode()), ", ",
            backend_->name(), " backend on device ", local_, data_comm_ ? ", " + data_comm_->name() + " for its memory" : "",
            ")");
}

void RankRun::abort_transport(const std::string& why) {
  if (data_comm_) data_comm_->abort(why);
}

RankRun::Boundary RankRun::agree(bool cancel_requested) {
  const RebalanceMailbox::View v = mailbox_.view();
  const int64_t world = job_.world_size();
  // [cancel, holds a PREPARE, its epoch (low 20 bits, exact in fp32), committed, aborted]
  float x[5] = {cancel_requested ? 1.0f : 0.0f, 0, 0, 0, 0};
  if (!staged_ && v.prepare) {
    x[1] = 1;
    x[2] = static_cast<float>(v.prepare->epoch() & 0xfffff);
  }
  if (staged_) {
    x[3] = v.committed == staged_->epoch() ? 1.0f : 0.0f;
    x[4] = v.aborted == staged_->epoch() ? 1.0f : 0.0f;
  }
  comm_.all_reduce_sum(x, 5, deadline());
  Boundary b;
  b.stop = x[0] > 0;
  b.stage = !staged_ && x[1] == static_cast<float>(world) && v.prepare &&
            x[2] == static_cast<float>(world * (v.prepare->epoch() & 0xfffff));
  if (b.stage) b.prepare = v.prepare;  // the mailbox may change after the vote
  b.abort = staged_ && x[4] > 0;
  b.commit = staged_ && !b.abort && x[3] == static_cast<float>(world);
  return b;
}

// Acts on the boundary's rebalance decision, before step `step` runs.
void RankRun::act(const Boundary& b, int step) {
  if (b.stage) {
    staged_ = b.prepare;
    staged_ready_ = false;
    stack_.stage(*staged_);
    log::info("job ", job_.job_id(), ": rank ", rank_, " staging epoch ", staged_->epoch(), " from step ", step);
    const bool gains = std::any_of(staged_->copies().begin(), staged_->copies().end(),
                                   [&](const v1::ExpertCopy& c) { return c.to_rank() == rank_; });
    if (env_.faults.refuse_copy && gains && mailbox_.claim_refusal(staged_->epoch())) {
      const auto c = std::find_if(staged_->copies().begin(), staged_->copies().end(),
                                  [&](const v1::ExpertCopy& c) { return c.to_rank() == rank_; });
      tell_agent_ready(false, "rank " + std::to_string(rank_) + " refuses the copy of layer " +
                                  std::to_string(c->layer()) + " expert " + std::to_string(c->expert()) +
                                  " from rank " + std::to_string(c->from_rank()) + " (injected fault)");
    }
  } else if (b.abort) {
    log::info("job ", job_.job_id(), ": rank ", rank_, " drops staged epoch ", staged_->epoch(), " before step ", step);
    stack_.drop_staged();
    mailbox_.done(staged_->epoch());
    staged_.reset();
  } else if (b.commit) {
    const int64_t copied = stack_.staged_bytes_received();
    const double t0 = now_seconds();
    stack_.switch_to_staged();
    log::info("job ", job_.job_id(), ": rank ", rank_, " switched to epoch ", staged_->epoch(), " before step ", step,
              " in ", now_seconds() - t0, " s (", copied, " bytes copied in)");
    if (env_.metrics) env_.metrics->record_rebalance_copy(copied);
    mailbox_.done(staged_->epoch());
    staged_.reset();
  }
}

// After a step: the staged copies progressed with the step's transfers; once
// this rank has all of its, it counts itself ready (the node's last one tells
// the agent).
void RankRun::check_staged() {
  if (!staged_ || staged_ready_ || !stack_.staged_ready()) return;
  staged_ready_ = true;
  if (env_.faults.stall_copy) return;  // test hook: this node's copies never complete
  if (mailbox_.rank_ready(staged_->epoch())) tell_agent_ready(true, "");
}

void RankRun::tell_agent_ready(bool ok, const std::string& reason) {
  v1::Envelope msg;
  v1::RebalanceReady* r = msg.mutable_rebalance_ready();
  r->set_job_id(job_.job_id());
  r->set_epoch(staged_->epoch());
  r->set_node(env_.node_name);
  r->set_ok(ok);
  r->set_reason(reason);
  agent_.call(msg, std::chrono::seconds(10));
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
    const Boundary b = agree(cancel_requested());
    if (b.stop) break;
    act(b, step);
    run_step(step);
    check_staged();
    if (checkpoint_due(step + 1)) write_checkpoint(job_, stack_, step + 1, rank_, comm_, deadline());
  }
  comm_.barrier(deadline());  // nobody tears down endpoints a peer still uses
  return step;
}

}  // namespace moe::node
