#include "moe/ep/ep_rebalance.h"

#include "moe/ep/ep_layer.h"
#include "moe/ep/trainable_tensor.h"

#include <algorithm>

#include "moe/base/check.h"
#include "moe/kernels/buffer.h"

namespace moe::ep {
StagedExperts::StagedExperts(ExpertMap next, std::vector<ExpertCopy> copies, int rank, const MoeLayerConfig& cfg,
                             bool adam, uint32_t tag_base)
    : next_(std::move(next)),
      copies_(std::move(copies)),
      rank_(rank),
      cfg_(cfg),
      adam_(adam && cfg.train),
      tag_base_(tag_base),
      shadows_(cfg.num_experts) {
  for (size_t c = 0; c < copies_.size(); ++c) {
    const ExpertCopy& p = copies_[c];
    MOE_CHECK(p.expert >= 0 && p.expert < cfg.num_experts && p.to_slot >= 0 && p.to_slot < next_.slots_per_rank &&
                  next_.expert_at(p.to_rank, p.to_slot) == p.expert,
              "rebalance: copy ", c, " (expert ", p.expert, " to rank ", p.to_rank, " slot ", p.to_slot,
              ") does not match the new map");
    shadows_[p.expert].push_back(static_cast<int>(c));
    max_shadows_ = std::max<int>(max_shadows_, shadows_[p.expert].size());
  }
}

void StagedExperts::start(const ExpertStage& stage, const ExpertMap& current, transport::Communicator& comm) {
  const int H = cfg_.hidden, I = cfg_.ffn_hidden;
  for (size_t c = 0; c < copies_.size(); ++c) {
    const ExpertCopy& p = copies_[c];
    const uint32_t tag = tag_base_ + static_cast<uint32_t>(c);
    if (p.from_rank == rank_) {
      int slot = 0;
      while (slot < current.slots_per_rank && current.expert_at(rank_, slot) != p.expert) ++slot;
      MOE_CHECK(slot < current.slots_per_rank, "rebalance: rank ", rank_, " sends expert ", p.expert,
                " but does not host it");
      ExpertState snapshot;
      snapshot.resize(H, I, adam_);
      stage.export_slot(slot, snapshot);
      Sent s{.wire = std::make_shared<std::vector<float>>(snapshot.to_wire())};
      s.transfer = comm.isend(p.to_rank, s.wire->data(), 4 * s.wire->size(), tag, s.wire);
      sent_.push_back(std::move(s));
    }
    if (p.to_rank == rank_) {
      Gained g{.copy = static_cast<int>(c), .state = std::make_shared<ExpertState>()};
      g.state->resize(H, I, adam_);
      g.wire = std::make_shared<std::vector<float>>(g.state->floats());
      g.transfer = comm.irecv(p.from_rank, g.wire->data(), 4 * g.wire->size(), tag, g.wire);
      gained_.push_back(std::move(g));
    }
  }
}

void StagedExperts::unpack(Gained& g) {
  g.state->from_wire(*g.wire);
  bytes_received_ += 4 * static_cast<int64_t>(g.wire->size());
  g.wire.reset();
  g.arrived = true;
}

bool StagedExperts::ready(transport::Communicator& comm, kernels::Backend& be) {
  for (Sent& s : sent_)
    if (!s.done) s.done = comm.test(s.transfer);
  bool all = true;
  for (Gained& g : gained_) {
    if (!g.arrived && comm.test(g.transfer)) {
      unpack(g);
      for (; !g.pending.empty(); g.pending.pop_front())  // the steps since the snapshot, in order
        apply(g, g.pending.front().grad.data(), g.pending.front().cfg, g.pending.front().step, be);
    }
    all &= g.arrived;
  }
  return all;
}

// One optimizer step on a shadow's fp32 master (and moments): the same op, on the
// same inputs, as its holders' TrainableTensor::update. The state lives in host
// memory; the backend steps a copy of it in its own memory, so the bits are the
// ones the holders' backend computes.
void StagedExperts::apply(Gained& g, const float* grad, const kernels::OptimizerConfig& cfg, int64_t step,
                          kernels::Backend& be) {
  ExpertState& s = *g.state;
  const size_t n = s.weights.size();
  auto in_backend = [&](const float* host) {
    kernels::Buffer b(be, 4 * n);
    be.copy_to_device(b.get(), host, 4 * n);
    return b;
  };
  kernels::Buffer w = in_backend(s.weights.data()), gr = in_backend(grad), m, v;
  const size_t moment_bytes = kernels::dtype_size(cfg.moments) * n;
  if (!s.m.empty()) {  // in the holders' moment dtype, so the step rounds as theirs does
    m = kernels::Buffer(be, moment_bytes);
    v = kernels::Buffer(be, moment_bytes);
    moments_to_device(be, m.get(), cfg.moments, n, s.m.data());
    moments_to_device(be, v.get(), cfg.moments, n, s.v.data());
  }
  kernels::OptimizerArgs a;
  a.count = static_cast<int64_t>(n);
  a.step = step;
  a.weight = w.as<float>();
  a.grad = gr.as<float>();
  a.m = m.get();
  a.v = v.get();
  be.optimizer_step(cfg, a);
  be.copy_to_host(s.weights.data(), w.get(), 4 * n);
  if (!s.m.empty()) {
    moments_to_host(be, m.get(), cfg.moments, n, s.m.data());
    moments_to_host(be, v.get(), cfg.moments, n, s.v.data());
  }
}

float* StagedExperts::shadow_gradient(int copy) {
  const auto it = std::find_if(gained_.begin(), gained_.end(), [&](const Gained& g) { return g.copy == copy; });
  MOE_ASSERT(it != gained_.end());
  it->grad.resize(it->state->weights.size());
  return it->grad.data();
}

void StagedExperts::optimizer_step(const kernels::OptimizerConfig& cfg, int64_t step, kernels::Backend& be) {
  for (Gained& g : gained_) {
    MOE_CHECK(g.grad.size() == g.state->weights.size(), "rebalance: shadow of expert ", copies_[g.copy].expert,
              " got no gradient this step");
    if (g.arrived) apply(g, g.grad.data(), cfg, step, be);
    else g.pending.push_back({g.grad, cfg, step});
    g.grad.clear();
  }
}

void StagedExperts::add_pass_gradients() {
  for (Gained& g : gained_) {
    if (g.grad_sum.empty()) g.grad_sum.swap(g.grad);
    else
      for (size_t i = 0; i < g.grad.size(); ++i) g.grad_sum[i] += g.grad[i];
    g.grad.clear();
  }
}

void StagedExperts::load_summed_gradients() {
  for (Gained& g : gained_) {
    g.grad.swap(g.grad_sum);
    g.grad_sum.clear();
  }
}

const ExpertState& StagedExperts::gained_state(int slot) const {
  for (const Gained& g : gained_)
    if (copies_[g.copy].to_slot == slot) {
      MOE_CHECK(g.arrived && g.pending.empty(), "rebalance: the copy of expert ", copies_[g.copy].expert,
                " to slot ", slot, " is not complete");
      return *g.state;
    }
  MOE_CHECK(false, "rebalance: rank ", rank_, " gains nothing at slot ", slot);
  throw;  // unreachable
}

// EpLayer's side of a live rebalance: staging, switching and dropping a map.

void EpLayer::stage(const ExpertMap& next, std::vector<ExpertCopy> copies, bool adam) {
  MOE_CHECK(next.num_experts == cfg_.num_experts && next.num_ranks == map_.num_ranks, "rebalance: the new map places ",
            next.num_experts, " experts on ", next.num_ranks, " ranks, the layer ", cfg_.num_experts, " on ",
            map_.num_ranks);
  next_.adam = adam && cfg_.train;
  next_.staged = std::make_unique<StagedExperts>(next, std::move(copies), comm_.rank(), cfg_, next_.adam, opts_.tag_base);
  next_.staged->start(*experts_, map_, comm_);
  if (next.slots_per_rank == map_.slots_per_rank) return;
  // Another slot count: the new stage and dispatcher are built (and their pages
  // faulted in) now, while copies stream, not at the switch.
  next_.experts = std::make_unique<ExpertStage>(cfg_, next.slots_per_rank, be_);
  next_.experts->reserve(std::max<int64_t>(scratch_.recv_capacity, cfg_.max_tokens));
  next_.experts->touch(next_.adam);
  next_.dispatcher = make_dispatcher(next);
}

bool EpLayer::staged_ready() {
  MOE_CHECK(next_.staged, "rebalance: nothing is staged");
  return next_.staged->ready(comm_, be_);
}

void EpLayer::drop_staged() {
  next_.staged.reset();
  next_.experts.reset();
  next_.dispatcher.reset();
}

int EpLayer::old_slot_of(int expert) const {
  for (int s = 0; s < map_.slots_per_rank; ++s)
    if (map_.expert_at(comm_.rank(), s) == expert) return s;
  return -1;
}

// The layer moves onto the staged map: every new slot takes its expert from the
// slot this rank already had (the same state, bit for bit) or from the staged
// copy.
void EpLayer::switch_to_staged() {
  MOE_CHECK(next_.staged, "rebalance: nothing is staged");
  const ExpertMap next = next_.staged->next();
  if (next_.experts) switch_to_new_stage(next);
  else switch_in_place(next);
  install_map(next);
  next_.staged.reset();
}

// Same slot count: only the slots whose expert changes are written; an expert
// moving between this rank's slots is read before any slot is overwritten.
void EpLayer::switch_in_place(const ExpertMap& next) {
  const int me = comm_.rank();
  std::vector<std::pair<int, ExpertState>> moves;
  for (int s = 0; s < next.slots_per_rank; ++s) {
    const int e = next.expert_at(me, s);
    if (e < 0 || e == map_.expert_at(me, s) || old_slot_of(e) < 0) continue;
    ExpertState st;
    st.resize(cfg_.hidden, cfg_.ffn_hidden, next_.adam);
    experts_->export_slot(old_slot_of(e), st);
    moves.emplace_back(s, std::move(st));
  }
  for (const auto& [s, st] : moves) experts_->import_slot(s, st);
  for (int s = 0; s < next.slots_per_rank; ++s) {
    const int e = next.expert_at(me, s);
    if (e >= 0 && e != map_.expert_at(me, s) && old_slot_of(e) < 0) experts_->import_slot(s, next_.staged->gained_state(s));
  }
}

// Another slot count: the stage built at staging takes every slot.
void EpLayer::switch_to_new_stage(const ExpertMap& next) {
  const int me = comm_.rank();
  for (int s = 0; s < next.slots_per_rank; ++s) {
    const int e = next.expert_at(me, s);
    if (e < 0) continue;
    const int old = old_slot_of(e);
    if (old >= 0) next_.experts->copy_slot(*experts_, old, s);
    else next_.experts->import_slot(s, next_.staged->gained_state(s));
  }
  experts_ = std::move(next_.experts);
  dispatcher_ = std::move(next_.dispatcher);
}

}  // namespace moe::ep
