#include "moe/node/rank_run.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <thread>

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
  p->set_world_epoch(world_epoch_);
  // An agent away (restarting on its state) is waited for: the restarted one
  // collects the world's addresses again.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    try {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      const v1::Envelope reply = agent_.call(req, std::max(left, std::chrono::milliseconds(1)));
      return {reply.bootstrap_addresses().blobs().begin(), reply.bootstrap_addresses().blobs().end()};
    } catch (const rpc::RpcError& e) {
      if (e.code() == v1::ERROR_CODE_UNAVAILABLE && std::chrono::steady_clock::now() + std::chrono::milliseconds(200) < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the agent's restart
        continue;
      }
      throw rpc::RpcError(e.code(), std::string("transport bootstrap through the agent: ") + e.what());
    }
  }
}

// One world of the job: the rank's number in it, its transports (bootstrapped
// among the world's ranks), the stack on the world's maps and the rebalance
// session. `start` is this world's: the spec's tokens_per_rank, the size, the
// maps and the data-plane key are the world's own.
struct RankRun::World {
  World(v1::StartJob s, int r, RankRun& run)
      : start(std::move(s)),
        rank(r),
        boot(run.agent_, start.job_id(), rank, start.world_epoch()),
        transports(transport::make_rank_transports({.rank = rank,
                                                    .world = start.world_size(),
                                                    .local = run.runner_.hub(start.world_epoch()),
                                                    .bootstrap = &boot,
                                                    .data_memory = data_memory(*run.backend_),
                                                    .device = run.local_,
                                                    .connect_timeout = run.env_.transport_timeout,
                                                    .job_key = start.data_plane_key()})),
        comm(*transports.host),
        stack(start.spec(), expert_maps(start), rank, start.world_size(), comm, *run.backend_, run.pool_,
              run.env_.transport_timeout, transports.data.get()),
        rebalance({.job_id = start.job_id(),
                   .node_name = run.env_.node_name,
                   .rank = rank,
                   .world = start.world_size(),
                   .faults = run.env_.faults,
                   .metrics = run.env_.metrics},
                  stack, run.runner_.rebalance_mailbox(), run.agent_) {}

  void abort(const std::string& why) {
    if (transports.data) transports.data->abort(why);
    comm.abort(why);
  }

  const v1::StartJob start;
  const int rank;
  AgentBootstrap boot;
  transport::RankTransports transports;  // host, and the backend's memory (null: host)
  transport::Communicator& comm;         // transports.host: control, counts, copies
  ModelStack stack;
  RebalanceSession rebalance;
};

RankRun::RankRun(const v1::StartJob& job, const RunnerEnv& env, int rank, int local, JobRunner& runner,
                 rpc::RpcClient& agent)
    : job_(job),
      env_(env),
      local_(local),
      runner_(runner),
      agent_(agent),
      pool_(env.threads_per_rank),
      backend_(env.make_backend(pool_, local_)) {
  world_ = std::make_unique<World>(job, rank, *this);
  verify_.set_passed(true);
  const v1::JobSpec& spec = job.spec();
  if (job.has_join()) {  // a node that joins a running elastic job: its state comes from the others
    if (job.join().rollback().empty())
      move_state(nullptr, *world_, job.join());
    else
      roll_back(*world_, job.join());
    first_step_ = job.join().resume_step();
    log::info("job ", job_.job_id(), ": rank ", rank, " joined world ", job.world_epoch(), " at step ", first_step_);
  } else if (!spec.resume().empty()) {  // the agent resolved and checked the folder
    const v1::CheckpointManifest m = spec::read_manifest(spec.resume());
    load_checkpoint(spec.resume(), m, world_->stack, world_->rank);
    first_step_ = m.step();
    log::info("job ", job_.job_id(), ": rank ", world_->rank, " resumed from ", spec.resume(), " at step ", first_step_);
  }
  applied_ = world_first_step_ = first_step_;
  place_ = {job.world_epoch(), rank};
  log::info("job ", job_.job_id(), ": rank ", world_->rank, " of ", job.world_size(), " ready (", spec.layers(),
            " layers, ", spec.tokens_per_rank(), " tokens, ", v1::JobSpec::Mode_Name(spec.mode()), ", ",
            backend_->name(), " backend on device ", local_, ", ", world_->comm.name(),
            world_->transports.data ? ", " + world_->transports.data->name() + " for its memory" : "",
            spec.elastic() ? ", elastic" : "", ")");
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
  const v1::JobSpec& spec = world_->start.spec();
  ModelStack& stack = world_->stack;
  // A resumed run covers its first step when asked for an earlier one.
  const bool verify = spec.verify() && step == std::max(spec.verify_step(), first_step_);
  const bool dump = !spec.dump_dir().empty() && step == std::max(spec.dump_step(), first_step_);
  const bool covered = verify || dump;
  const bool train = spec.mode() == v1::JobSpec::train;
  StepReport report(step, spec.experts());
  report.set_world_epoch(world_->start.world_epoch());
  const double t0 = now_seconds();
  stack.forward(step, report, covered);
  // The weights this step uses, before its optimizer step changes them.
  std::vector<model::LayerWeights> weights;
  if (covered) weights = stack.weights_in_use(step, deadline());
  if (train) {
    stack.backward(report, covered);
    const std::string bad = nonfinite(report);
    pending_ = true;  // from here its reduced gradients are whole: an elastic restart may apply them
    if (spec.elastic()) pending_report_ = report;
    agree(step, bad, report);
  }
  report.set_step_seconds(now_seconds() - t0);
  finish_step(step, report);
  // The covered step's snapshots, gradients (the optimizer leaves them) and
  // weights are what verify and the dump need.
  if (verify) verify_ = verify_step(spec, stack, weights, world_->rank, world_->comm, deadline());
  if (dump) dump_step(spec, stack, weights[0], world_->rank);
}

// The step's local end, which no peer can interrupt: the optimizer step (train),
// the bias update, and the report.
void RankRun::finish_step(int step, StepReport& report) {
  ModelStack& stack = world_->stack;
  if (world_->start.spec().mode() == v1::JobSpec::train) {
    const double t = now_seconds();
    stack.optimize(step, report);
    report.set_step_seconds(report.stats().step_seconds() + now_seconds() - t);
  }
  stack.update_selection_bias();
  applied_ = step + 1;
  pending_ = false;
  pending_report_.reset();
  report.record(env_.metrics, world_->rank);
  send_report(report);
}

void RankRun::send_report(const StepReport& report) {
  v1::Envelope msg;
  auto* r = msg.mutable_step_report();
  r->set_job_id(job_.job_id());
  r->set_rank(world_->rank);
  *r->mutable_stats() = report.stats();
  env_.reports->send(std::move(msg));  // held while the agent is away
}

// A checkpoint after `done` steps: every checkpoint_every steps and at the end.
bool RankRun::checkpoint_due(int done) const {
  const v1::JobSpec& spec = world_->start.spec();
  if (spec.checkpoint_dir().empty()) return false;
  const int every = spec.checkpoint_every();
  return done == spec.steps() || (every > 0 && done % every == 0);
}

int RankRun::run_world(const std::function<bool()>& cancel_requested) {
  const int steps = world_->start.spec().steps();
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
      if (!job_.spec().elastic()) throw;
      // Every step done: the failure was in the closing barrier, which only
      // keeps endpoints up while a peer may still use them.
      if (applied_ >= job_.spec().steps()) return applied_;
      report_halted(e.what(), e.peer());
    } catch (const rpc::RpcError& e) {
      // A world halted (or replaced) while its ranks bootstrapped it.
      if (!next || e.code() != v1::ERROR_CODE_FAILED_PRECONDITION) throw;
      report_halted(e.what(), -1);
    }
    next = runner_.next_world(place_.epoch);
    if (!next) return applied_;  // cancelled, or the job failed, while it waited
  }
}

// The rank's place is the world it was last told to be in (its stack may still be
// an older world's, when it was halted while moving): `hosted` says what it holds.
void RankRun::report_halted(const std::string& why, int failed_peer) {
  log::warn("job ", job_.job_id(), ": rank ", place_.rank, " halted world ", place_.epoch, " with ", applied_,
            " step(s) applied", pending_ ? " and the next one's gradients" : "", ": ", why);
  v1::Envelope msg;
  auto* h = msg.mutable_rank_halted();
  h->set_job_id(job_.job_id());
  h->set_rank(place_.rank);
  h->set_world_epoch(place_.epoch);
  h->set_applied_steps(applied_);
  h->set_pending(pending_);
  h->set_message(why);
  if (failed_peer >= 0) h->set_failed_peer(failed_peer);
  for (int l = 0; l < world_->stack.num_layers(); ++l) {
    std::vector<bool> hosted = world_->stack.map(l).hosted(world_->rank);
    for (const auto& w : retired_) {  // an earlier world's stack, kept until the new world proved itself
      const std::vector<bool> also = w->stack.map(l).hosted(w->rank);
      for (size_t e = 0; e < hosted.size() && e < also.size(); ++e) hosted[e] = hosted[e] || also[e];
    }
    auto* layer = h->add_hosted();
    for (size_t e = 0; e < hosted.size(); ++e)
      if (hosted[e]) layer->add_experts(static_cast<int>(e));
  }
  env_.reports->send(std::move(msg));
}

// Train: a rank that reached the agreement of the step the others applied applies
// it too (its reduced gradients are those every rank applied). Forward: a rank
// that finished a step no other survivor did takes its bias update back.
void RankRun::catch_up(int resume_step) {
  const bool train = world_->start.spec().mode() == v1::JobSpec::train;
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
  std::unique_ptr<World> fresh = std::make_unique<World>(std::move(start), place_.rank, *this);
  {  // a halt of the new world from now on aborts its transports (at once if it came already)
    std::lock_guard<std::mutex> lock(world_mu_);
    entering_ = fresh.get();
    if (runner_.halted_epoch() >= next.world_epoch()) fresh->abort("world " + std::to_string(next.world_epoch()) + " halted");
  }
  struct Entered {
    RankRun* self;
    ~Entered() {
      std::lock_guard<std::mutex> lock(self->world_mu_);
      self->entering_ = nullptr;
    }
  } entered{this};
  if (next.rollback().empty())
    move_state(world_.get(), *fresh, next);
  else
    roll_back(*fresh, next);
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
            " in world ", next.world_epoch(), " (", world_->start.spec().tokens_per_rank(),
            " tokens), resuming at step ", world_first_step_, " after ", now_seconds() - t0, " s");
}

// An expert was lost with no surviving copy: every rank of the new world reads
// the checkpoint the agent chose (a consistent cut), whatever shape wrote it.
void RankRun::roll_back(World& to, const v1::NewWorld& next) {
  const v1::CheckpointManifest m = spec::read_manifest(next.rollback());
  MOE_CHECK(m.step() == next.resume_step(), "world change: the checkpoint ", next.rollback(), " is of step ", m.step(),
            ", the new world resumes at ", next.resume_step());
  load_checkpoint(next.rollback(), m, to.stack, to.rank);
  to.comm.barrier(deadline());
  log::info("job ", job_.job_id(), ": rank ", to.rank, " rolled back to ", next.rollback(), " (step ", m.step(), ")");
}

namespace {

constexpr uint32_t kReplicatedTag = 1u << 30;  // apart from the moves' tags (their index)

void wait_for(transport::Communicator& comm, transport::Communicator::TransferId id, transport::Deadline until,
              const std::string& what) {
  while (!comm.test(id)) {
    MOE_CHECK(transport::Clock::now() < until, "world change: ", what, " did not complete in time");
    std::this_thread::yield();
  }
}

}  // namespace

// What every rank holds alike (router, shared experts, their optimizer state,
// the selection bias): a rank that had it keeps its own (identical on every
// survivor once each caught up); a joining rank gets it from the first rank
// that has it.
void RankRun::move_replicated(World* from, World& to, const v1::NewWorld& next) {
  const v1::JobSpec& spec = to.start.spec();
  const bool train = spec.mode() == v1::JobSpec::train;
  const bool moments = train && spec.optimizer() != v1::JobSpec::sgd;
  const int L = to.stack.num_layers();
  std::vector<bool> has(next.world_size(), false);
  for (int r : next.new_rank())
    if (r >= 0) has[r] = true;
  const int source = static_cast<int>(std::find(has.begin(), has.end(), true) - has.begin());
  MOE_CHECK(source < next.world_size(), "world change: no rank of world ", next.world_epoch(), " has the job's state");
  auto state_of = [&](const ep::EpLayer& layer) {
    ep::EpLayer::ReplicatedState st;
    if (train) st = layer.replicated_state(moments);
    st.selection_bias = layer.selection_bias();
    return st;
  };
  auto install = [&](ep::EpLayer& layer, const ep::EpLayer::ReplicatedState& st) {
    if (train) layer.set_replicated_state(st);
    layer.set_selection_bias(st.selection_bias);
  };
  const transport::Deadline until = deadline();
  if (from) {
    for (int l = 0; l < L; ++l) install(to.stack.layer(l), state_of(from->stack.layer(l)));
    if (to.rank != source) return;
    auto sizes = std::make_shared<std::vector<int64_t>>();
    auto payload = std::make_shared<std::vector<float>>();
    for (int l = 0; l < L; ++l) {
      ep::EpLayer::ReplicatedState st = state_of(from->stack.layer(l));
      for (const auto* v : st.arrays()) {
        sizes->push_back(static_cast<int64_t>(v->size()));
        payload->insert(payload->end(), v->begin(), v->end());
      }
    }
    std::vector<transport::Communicator::TransferId> sent;
    for (int r = 0; r < next.world_size(); ++r) {
      if (has[r]) continue;
      sent.push_back(to.comm.isend(r, sizes->data(), sizes->size() * sizeof(int64_t), kReplicatedTag, sizes));
      sent.push_back(to.comm.isend(r, payload->data(), payload->size() * sizeof(float), kReplicatedTag + 1, payload));
    }
    for (const auto id : sent) wait_for(to.comm, id, until, "sending the replicated state to a joining rank");
    return;
  }
  auto sizes = std::make_shared<std::vector<int64_t>>(ep::EpLayer::ReplicatedState{}.arrays().size() * L);
  wait_for(to.comm, to.comm.irecv(source, sizes->data(), sizes->size() * sizeof(int64_t), kReplicatedTag, sizes), until,
           "the replicated state's sizes");
  int64_t total = 0;
  for (int64_t n : *sizes) total += n;
  auto payload = std::make_shared<std::vector<float>>(total);
  wait_for(to.comm, to.comm.irecv(source, payload->data(), payload->size() * sizeof(float), kReplicatedTag + 1, payload),
           until, "the replicated state");
  size_t at = 0, k = 0;
  for (int l = 0; l < L; ++l) {
    ep::EpLayer::ReplicatedState st;
    for (auto* v : st.arrays()) {
      v->assign(payload->begin() + at, payload->begin() + at + (*sizes)[k]);
      at += (*sizes)[k++];
    }
    install(to.stack.layer(l), st);
  }
}

// Where this rank holds expert e of layer l: the stack it moves from, else one
// it retired (null: nowhere).
std::pair<RankRun::World*, int> RankRun::holder(const std::vector<World*>& held, int l, int e) const {
  for (World* w : held) {
    const moe::ExpertMap& m = w->stack.map(l);
    for (int s = 0; s < m.slots_per_rank; ++s)
      if (m.expert_at(w->rank, s) == e) return {w, s};
  }
  return {nullptr, -1};
}

// Posts every move of `next` this rank sends or receives; returns the receives.
std::vector<RankRun::Incoming> RankRun::post_moves(const std::vector<World*>& held, World& to,
                                                   const v1::NewWorld& next,
                                                   std::vector<transport::Communicator::TransferId>& outgoing) {
  const v1::JobSpec& spec = to.start.spec();
  const bool moments = spec.optimizer() != v1::JobSpec::sgd;
  std::vector<Incoming> incoming;
  for (int i = 0; i < next.moves_size(); ++i) {
    const v1::ExpertMove& mv = next.moves(i);
    if (mv.from_rank() == to.rank && mv.to_rank() != to.rank) {
      const auto [w, s] = holder(held, mv.layer(), mv.expert());
      MOE_CHECK(w, "world change: told to send expert ", mv.expert(), " of layer ", mv.layer(),
                ", which this rank does not hold");
      ep::ExpertState st;
      st.resize(spec.hidden(), spec.ffn_hidden(), moments);
      w->stack.layer(mv.layer()).export_slot(s, st);
      auto wire = std::make_shared<std::vector<float>>(st.to_wire());
      outgoing.push_back(to.comm.isend(mv.to_rank(), wire->data(), wire->size() * sizeof(float), i, wire));
    }
    if (mv.to_rank() == to.rank && mv.from_rank() != to.rank) {
      Incoming in{mv.layer(), mv.expert(), std::make_shared<ep::ExpertState>(), nullptr, 0};
      in.state->resize(spec.hidden(), spec.ffn_hidden(), moments);
      in.wire = std::make_shared<std::vector<float>>(in.state->floats());
      in.id = to.comm.irecv(mv.from_rank(), in.wire->data(), in.wire->size() * sizeof(float), i, in.wire);
      incoming.push_back(std::move(in));
    }
  }
  return incoming;
}

// Each slot of the new stack takes its expert from the old stack when this rank
// held it, else from the rank the agent named (a surviving replica, bitwise
// equal to the lost one). A forward job's experts are the spec's, built by the
// new stack.
void RankRun::move_state(World* from, World& to, const v1::NewWorld& next) {
  const v1::JobSpec& spec = to.start.spec();
  move_replicated(from, to, next);
  const transport::Deadline until = deadline();
  if (spec.mode() != v1::JobSpec::train) return to.comm.barrier(until);
  const bool moments = spec.optimizer() != v1::JobSpec::sgd;
  std::vector<World*> held;
  if (from) held.push_back(from);
  for (const auto& w : retired_) held.push_back(w.get());
  std::vector<transport::Communicator::TransferId> outgoing;
  std::vector<Incoming> incoming = post_moves(held, to, next, outgoing);
  std::set<std::pair<int, int>> moved_here;
  for (const Incoming& in : incoming) moved_here.insert({in.layer, in.expert});
  for (int l = 0; l < to.stack.num_layers(); ++l) {  // the experts this rank keeps
    for (int s = 0; s < to.stack.map(l).slots_per_rank; ++s) {
      const int e = to.stack.map(l).expert_at(to.rank, s);
      if (e < 0 || moved_here.count({l, e})) continue;
      const auto [w, o] = holder(held, l, e);
      MOE_CHECK(w, "world change: no source for expert ", e, " of layer ", l, " on rank ", to.rank);
      ep::ExpertState st;
      st.resize(spec.hidden(), spec.ffn_hidden(), moments);
      w->stack.layer(l).export_slot(o, st);
      to.stack.layer(l).import_slot(s, st);
    }
  }
  for (Incoming& in : incoming) {
    wait_for(to.comm, in.id, until, "expert " + std::to_string(in.expert) + " of layer " + std::to_string(in.layer));
    in.state->from_wire(*in.wire);
    const moe::ExpertMap& m = to.stack.map(in.layer);  // every slot of the expert here
    for (int s = 0; s < m.slots_per_rank; ++s)
      if (m.expert_at(to.rank, s) == in.expert) to.stack.layer(in.layer).import_slot(s, *in.state);
  }
  for (const auto id : outgoing) wait_for(to.comm, id, until, "an expert copy");
  to.comm.barrier(until);
}

}  // namespace moe::node
