#include "moe/node/rank_run.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "moe/base/clock.h"
#include "moe/base/log.h"
#include "moe/node/checkpoint.h"
#include "moe/node/dump.h"
#include "moe/layer_spec/job_layers.h"
#include "moe/node/serve_loop.h"
#include "moe/node/verify.h"
#include "rank_world.h"
#include "moe/spec/checkpoint_manifest.h"

namespace moe::node {
RankRun::RankRun(const v1::StartJob& job, const RunnerEnv& env, int rank, int local, JobRunner& runner,
                 rpc::RpcClient& agent)
    : job_(job),
      env_(env),
      local_(local),
      runner_(runner),
      agent_(agent),
      pool_(env.threads_per_rank),
      backend_(env.make_backend(pool_, local_)) {
  world_ = std::make_unique<World>(job, rank, world_env());
  verify_.set_passed(true);
  const layer_spec::JobView& view = world_->job();
  if (job.has_join()) {  // a node that joins a running elastic job: its state comes from the others
    if (job.join().rollback().empty())
      move_state(held(nullptr), false, target(*world_), job.join(), deadline());
    else
      roll_back(target(*world_), job.join(), deadline());
    first_step_ = job.join().resume_step();
    log::info("job ", job_.job_id(), ": rank ", rank, " joined world ", job.world_epoch(), " at step ", first_step_);
  } else if (!view.resume.empty()) {  // the agent resolved and checked the folder
    const v1::CheckpointManifest m = spec::read_manifest(view.resume);
    load_checkpoint(view.resume, m, world_->stack, world_->rank);
    // A serving job's checkpoint counts optimizer steps (its serving node starts
    // there, serving_node.cc); its reporting windows count from 0.
    first_step_ = view.serve ? 0 : m.step();
    log::info("job ", job_.job_id(), ": rank ", world_->rank, " resumed from ", view.resume, " at step ", first_step_);
  }
  applied_ = world_first_step_ = first_step_;
  place_ = {job.world_epoch(), rank};
  log::info("job ", job_.job_id(), ": rank ", world_->rank, " of ", job.world_size(), " ready (", view.layers,
            " layers, ", view.tokens_per_rank, " tokens, ", view.train ? "train" : "forward", ", ",
            backend_->name(), " backend on device ", local_, ", ", world_->comm.name(),
            world_->transports.data ? ", " + world_->transports.data->name() + " for its memory" : "",
            view.elastic ? ", elastic" : "", ")");
}

RankRun::~RankRun() = default;

int RankRun::rank() const { return place_.rank; }

int64_t RankRun::world_epoch() const { return place_.epoch; }

void RankRun::abort_transport(const std::string& why, int64_t epoch) {
  std::lock_guard<std::mutex> lock(world_mu_);
  for (World* w : {world_.get(), entering_})
    if (w && (epoch < 0 || epoch == w->start.world_epoch())) w->abort(why);
}

bool RankRun::agree_and_act(bool cancel_requested, int step) {
  float vote[1 + RebalanceSession::kVoteFloats] = {cancel_requested ? 1.0f : 0.0f};
  world_->rebalance.vote(vote + 1);
  world_->comm.all_reduce_sum(vote, std::size(vote), deadline());
  if (vote[0] > 0) return true;
  world_->rebalance.act(vote + 1, step);
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
  if (const int l = world_->stack.first_nonfinite_router_gradient(); l >= 0)
    return "layer " + std::to_string(l) + "'s router gradient is not finite";
  return "";
}

// Collective, after a train step's backward and before its optimizer step: every
// rank learns every rank's loss shares (so each report carries the step's whole
// loss, summed in rank order) and whether any rank's step was not finite; if so
// every rank fails the job with the same message naming the step and the ranks,
// before the optimizer or a checkpoint uses the state.
void RankRun::agree(int step, const std::string& nonfinite_here, StepReport& report) {
  transport::Communicator& comm = world_->comm;
  const int R = comm.size();
  const v1::StepStats& s = report.stats();
  const double mine[4] = {nonfinite_here.empty() ? 0.0 : 1.0, s.loss(), s.aux_loss(), s.z_loss()};
  std::vector<double> send(4 * R), recv(4 * R);
  for (int r = 0; r < R; ++r) std::memcpy(&send[4 * r], mine, sizeof mine);
  const transport::Segments segs = transport::Segments::packed(std::vector<size_t>(R, sizeof mine));
  comm.all_to_all_v(send.data(), segs, recv.data(), segs, deadline());
  double loss = 0, aux = 0, z = 0;
  std::string which;
  for (int r = 0; r < R; ++r) {
    if (recv[4 * r] != 0) which += (which.empty() ? "" : ", ") + std::to_string(r);
    loss += recv[4 * r + 1];
    aux += recv[4 * r + 2];
    z += recv[4 * r + 3];
  }
  report.set_job_losses(loss, aux, z);
  if (which.empty()) return;
  report.set_step_seconds(std::max(report.stats().step_seconds(), 1e-9));
  send_report(report);  // the failing step's losses show in the result
  MOE_CHECK(false, "step ", step, ": not finite on rank(s) ", which,
            nonfinite_here.empty() ? "" : " (here: " + nonfinite_here + ")");
}

void RankRun::run_step(int step) {
  const layer_spec::JobView& job = world_->job();
  ModelStack& stack = world_->stack;
  // A resumed run covers its first step when asked for an earlier one.
  const bool verify = job.verify && step == std::max(job.verify_step, first_step_);
  const bool dump = !job.dump_dir.empty() && step == std::max(job.dump_step, first_step_);
  const bool covered = verify || dump;
  StepReport report(step, job.shape.num_experts);
  report.set_world_epoch(world_->start.world_epoch());
  const double t0 = now_seconds();
  stack.forward(step, report, covered);
  // The weights this step uses, before its optimizer step changes them.
  std::vector<model::LayerWeights> weights;
  if (covered) weights = stack.weights_in_use(step, deadline());
  if (job.train) {
    stack.backward(report, covered);
    const std::string bad = nonfinite(report);
    pending_ = true;  // from here its reduced gradients are whole: an elastic restart may apply them
    if (job.elastic) pending_report_ = report;
    agree(step, bad, report);
  }
  report.set_step_seconds(now_seconds() - t0);
  finish_step(step, report);
  // The covered step's snapshots, gradients (the optimizer leaves them) and
  // weights are what verify and the dump need.
  if (verify) verify_ = verify_step(job, stack, weights, world_->rank, world_->comm, deadline());
  if (dump) dump_step(job, stack, weights[0], world_->rank);
}

// The step's local end, which no peer can interrupt: the optimizer step (train),
// the bias update, and the report.
void RankRun::finish_step(int step, StepReport& report) {
  ModelStack& stack = world_->stack;
  if (world_->job().train) {
    const double t = now_seconds();
    stack.optimize(step, report);
    report.set_step_seconds(report.stats().step_seconds() + now_seconds() - t);
  }
  stack.update_selection_bias();
  applied_ = step + 1;
  pending_ = false;
  pending_report_.reset();
  report.record(env_.metrics, world_->rank, local_);
  send_report(report);
}

void RankRun::send_report(const StepReport& report) { send_stats(report.stats()); }

void RankRun::send_stats(const v1::StepStats& stats) {
  v1::Envelope msg;
  auto* r = msg.mutable_step_report();
  r->set_job_id(job_.job_id());
  r->set_rank(world_->rank);
  *r->mutable_stats() = stats;
  env_.reports->send(std::move(msg));  // held while the agent is away
}

// A checkpoint after `done` steps: every checkpoint_every steps and at the end.
bool RankRun::checkpoint_due(int done) const {
  const layer_spec::JobView& job = world_->job();
  if (job.checkpoint_dir.empty()) return false;
  const int every = job.checkpoint_every;
  return done == job.steps || (every > 0 && done % every == 0);
}

int RankRun::run_world(const std::function<bool()>& cancel_requested) {
  if (world_->job().serve) {  // docs/serving.md: until cancelled; its steps are not the job's
    serve_until_cancelled({.comm = world_->comm,
                           .stack = world_->stack,
                           .rebalance = world_->rebalance,
                           .node = *runner_.serving(),
                           .first_on_node = local_ == 0,
                           .timeout = env_.transport_timeout,
                           .rank = world_->rank,
                           .device = local_,
                           .world_epoch = world_->start.world_epoch(),
                           .first_window = world_first_step_,
                           .start = world_->start,
                           .optimizer_steps = runner_.serving()->requests.steps(),
                           .metrics = env_.metrics,
                           .report =
                               [this](const v1::StepStats& stats) {
                                 applied_ = stats.step() + 1;  // an elastic change resumes the numbering
                                 send_stats(stats);
                               },
                           .after_step = [this] { retired_.clear(); }},
                          cancel_requested);
    world_->comm.barrier(deadline());
    return 0;
  }
  const int steps = world_->job().steps;
  int step = world_first_step_;
  for (; step < steps; ++step) {
    if (agree_and_act(cancel_requested(), step)) break;
    run_step(step);
    retired_.clear();  // every rank of this world completed a step in it
    world_->rebalance.after_step();
    if (checkpoint_due(step + 1))
      write_checkpoint(world_->start, world_->stack, step + 1, world_->rank, world_->comm, deadline());
  }
  world_->comm.barrier(deadline());  // nobody tears down endpoints a peer still uses
  return step;
}

int RankRun::run(const std::function<bool()>& cancel_requested) {
  std::optional<v1::NewWorld> next;
  for (;;) {
    try {
      if (next) enter(*next);
      return run_world(cancel_requested);
    } catch (const transport::TransportError& e) {
      if (!world_->job().elastic) throw;
      // Every step done: the failure was in the closing barrier, which only
      // keeps endpoints up while a peer may still use them.
      if (!world_->job().serve && applied_ >= world_->job().steps) return applied_;
      report_halted(e.what(), e.peer());
    } catch (const rpc::RpcError& e) {
      // A world halted (or replaced) while its ranks bootstrapped it.
      if (!next || e.code() != v1::ERROR_CODE_FAILED_PRECONDITION) throw;
      report_halted(e.what(), -1);
    }
    next = runner_.worlds().next_after(place_.epoch);
    if (!next) return applied_;  // cancelled, or the job failed, while it waited
  }
}

// The rank's place is the world it was last told to be in (its stack may still be
// an older world's, when it was halted while moving): `hosted` says what it holds.
void RankRun::report_halted(const std::string& why, int failed_peer) {
  log::warn("job ", job_.job_id(), ": rank ", place_.rank, " halted world ", place_.epoch, " with ", applied_,
            " step(s) applied", pending_ ? " and the next one's gradients" : "", ": ", why);
  env_.reports->send(rank_halted({job_.job_id(), place_.rank, place_.epoch, applied_, pending_, why, failed_peer},
                                 held(world_.get())));
}

// Train: a rank that reached the agreement of the step the others applied applies
// it too (its reduced gradients are those every rank applied). Forward: a rank
// that finished a step no other survivor did takes its bias update back.
void RankRun::catch_up(int resume_step) {
  const bool train = world_->job().train;
  if (train && applied_ == resume_step - 1 && pending_ && pending_report_) {
    StepReport report = *pending_report_;
    finish_step(resume_step - 1, report);
    log::info("job ", job_.job_id(), ": rank ", world_->rank, " applied step ", resume_step - 1,
              " from its reduced gradients before the world change");
  } else if (!train && applied_ == resume_step + 1) {
    world_->stack.undo_selection_bias();
    applied_ = resume_step;
  }
  MOE_CHECK(applied_ == resume_step, "world change: rank ", world_->rank, " applied ", applied_,
            " step(s); the new world resumes at step ", resume_step);
}

void RankRun::enter(const v1::NewWorld& next) {
  const int old_rank = place_.rank;
  MOE_CHECK(old_rank < next.new_rank_size() && next.new_rank(old_rank) >= 0, "world change: rank ", old_rank,
            " is not in world ", next.world_epoch());
  if (next.rollback().empty()) {
    catch_up(next.resume_step());
  } else {  // every rank goes back to the checkpoint: what it applied since is dropped
    applied_ = next.resume_step();
    pending_ = false;
    pending_report_.reset();
  }
  place_ = {next.world_epoch(), next.new_rank(old_rank)};
  world_->stack.drop_staged();
  v1::StartJob start = world_->start;
  start.set_world_size(next.world_size());
  start.set_world_epoch(next.world_epoch());
  start.set_data_plane_key(next.data_plane_key());
  *start.mutable_maps() = next.maps();
  start.mutable_spec()->set_tokens_per_rank(next.tokens_per_rank());
  const double t0 = now_seconds();
  std::unique_ptr<World> fresh = std::make_unique<World>(std::move(start), place_.rank, world_env());
  {  // a halt of the new world from now on aborts its transports (at once if it came already)
    std::lock_guard<std::mutex> lock(world_mu_);
    entering_ = fresh.get();
    if (runner_.worlds().halted_epoch() >= next.world_epoch()) fresh->abort("world " + std::to_string(next.world_epoch()) + " halted");
  }
  struct Entered {
    RankRun* self;
    ~Entered() {
      std::lock_guard<std::mutex> lock(self->world_mu_);
      self->entering_ = nullptr;
    }
  } entered{this};
  if (next.rollback().empty())
    move_state(held(world_.get()), true, target(*fresh), next, deadline());
  else
    roll_back(target(*fresh), next, deadline());
  {
    std::lock_guard<std::mutex> lock(world_mu_);
    std::swap(world_, fresh);
    entering_ = nullptr;
  }
  // The old stack stays until the new world completes a step: a peer may have
  // been halted before it took the experts this rank gave it, and then this
  // rank's old slots are where they are.
  retired_.push_back(std::move(fresh));
  world_first_step_ = next.resume_step();
  log::info("job ", job_.job_id(), ": rank ", old_rank, " is rank ", world_->rank, " of ", next.world_size(),
            " in world ", next.world_epoch(), " (", world_->job().tokens_per_rank,
            " tokens), resuming at step ", world_first_step_, " after ", now_seconds() - t0, " s");
}

RankWorldEnv RankRun::world_env() { return {agent_, runner_, *backend_, pool_, local_, env_}; }

WorldTarget RankRun::target(World& w) const { return {w.stack, w.rank, w.comm, w.job(), job_.job_id()}; }

std::vector<HeldStack> RankRun::held(World* from) const {
  std::vector<HeldStack> out;
  if (from) out.push_back({from->stack, from->rank});
  for (const auto& w : retired_) out.push_back({w->stack, w->rank});
  return out;
}

}  // namespace moe::node
