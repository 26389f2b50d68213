#include "moe/ep/ep_layer.h"

#include <algorithm>
#include <cstring>

#include "moe/base/check.h"

namespace moe::ep {

using kernels::Buffer;

namespace {

DispatcherConfig dispatcher_config(const MoeLayerConfig& cfg, const ExpertMap& map) {
  return {.hidden = cfg.hidden,
          .top_k = cfg.top_k,
          .dtype = cfg.dtype,
          .max_tokens = cfg.max_tokens,
          .num_ranks = map.num_ranks,
          .slots_per_rank = map.slots_per_rank,
          .train = cfg.train};
}

}  // namespace

EpLayer::EpLayer(const MoeLayerConfig& cfg, const ExpertMap& map, transport::Communicator& comm,
                 kernels::Backend& be, const EpOptions& options)
    : cfg_(cfg),
      map_(map),
      comm_(comm),
      data_(options.data_comm ? *options.data_comm : comm),
      be_(be),
      opts_(options),
      router_(cfg, be),
      dispatcher_(std::make_unique<Dispatcher>(
          dispatcher_config(cfg, map), data_, be,
          DispatcherOptions{.timeout = options.timeout, .isolate_transport_timing = options.isolate_transport_timing})),
      experts_(std::make_unique<ExpertStage>(cfg, map.slots_per_rank, be)) {
  MOE_CHECK(map.num_experts == cfg.num_experts, "ep layer: the map places ", map.num_experts,
            " experts, the layer has ", cfg.num_experts);
  const size_t T = cfg.max_tokens, K = cfg.top_k, H = cfg.hidden;
  install_map(map);
  topk_slot_ = Buffer(be_, 4 * T * K);
  if (cfg.train) {
    grad_topk_weight_ = Buffer(be_, 4 * T * K);
    grad_x32_ = Buffer(be_, 4 * T * H);
  }
  reserve_rows(T);  // a first guess; grows when a step receives more
  if (cfg.shared_ffn_hidden > 0) shared_ = std::make_unique<SharedExperts>(cfg, be);
  if (cfg.global_counts) counts_dev_ = Buffer(be_, 4 * static_cast<size_t>(cfg.num_experts));
}

// The replica tables the router's replica choice reads.
void EpLayer::install_map(const ExpertMap& map) {
  map_ = map;
  log2phy_ = Buffer(be_, 4 * map.log2phy.size());
  logcnt_ = Buffer(be_, 4 * map.logcnt.size());
  be_.copy_to_device(log2phy_.get(), map.log2phy.data(), 4 * map.log2phy.size());
  be_.copy_to_device(logcnt_.get(), map.logcnt.data(), 4 * map.logcnt.size());
}

// Buffers of the received rows' results: combined rows, and in train mode the
// per-pair weight gradients.
void EpLayer::reserve_rows(int64_t n) {
  if (n <= recv_capacity_) return;
  recv_capacity_ = n;
  const size_t N = n, K = cfg_.top_k;
  combined_ = Buffer(be_, N * kernels::dtype_size(cfg_.dtype) * cfg_.hidden);
  if (cfg_.train) grad_pair_weight_ = Buffer(be_, 4 * N * K);
  experts_->reserve(n);
}

void EpLayer::set_weights(const model::LayerWeights& w) {
  check_expert_weights(cfg_, w);
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, S = map_.slots_per_rank;
  // The router and this rank's slots only (empty slots stay zero), rounded once.
  model::LayerWeights local;
  local.gate = w.gate;
  local.selection_bias = w.selection_bias;
  local.logit_bias = w.logit_bias;
  local.w13.assign(S * 2 * I * H, 0.0f);
  local.w2.assign(S * H * I, 0.0f);
  for (size_t s = 0; s < S; ++s) {
    const int32_t e = map_.expert_at(comm_.rank(), static_cast<int>(s));
    if (e < 0) continue;
    std::copy_n(w.w13.begin() + e * 2 * I * H, 2 * I * H, local.w13.begin() + s * 2 * I * H);
    std::copy_n(w.w2.begin() + e * H * I, H * I, local.w2.begin() + s * H * I);
  }
  local.shared_w13 = w.shared_w13;
  local.shared_w2 = w.shared_w2;
  local.shared_gate = w.shared_gate;
  local = weights_as_used(std::move(local), cfg_.dtype);
  router_.set_weights(local);
  experts_->set_weights(local.w13.data(), local.w2.data());
  if (shared_) shared_->set_weights(local);
  selection_bias_ = local.selection_bias;
}

// c_e and T_g of the step over every rank (counts are integers: the float sum is exact).
void EpLayer::gather_counts() {
  counts_ = router_.expert_counts();
  comm_.all_reduce_sum(counts_.data(), counts_.size(), deadline());
  double pairs = 0;
  for (float c : counts_) pairs += c;
  global_tokens_ = pairs / cfg_.top_k;
  be_.copy_to_device(counts_dev_.get(), counts_.data(), 4 * counts_.size());
  if (!cfg_.train || (cfg_.aux_loss_coeff == 0 && cfg_.z_loss_coeff == 0)) return;
  std::vector<float> logits, scores;
  router_.copy_logits(logits, scores);
  losses_ = ep::balance_losses(cfg_.routing(), cfg_.aux_loss_coeff, cfg_.z_loss_coeff, logits, scores,
                               router_.num_tokens(), counts_, global_tokens_);
}

RouterBalance EpLayer::balance_terms() const {
  if (!cfg_.global_counts) return {};
  return {.aux_scale = static_cast<float>(aux_loss_scale(cfg_.aux_loss_coeff, cfg_.num_experts, cfg_.top_k, global_tokens_)),
          .z_scale = static_cast<float>(z_loss_scale(cfg_.z_loss_coeff, global_tokens_)),
          .counts = counts_dev_.as<float>()};
}

EpLayer::ReplicatedState EpLayer::replicated_state(bool moments) const {
  ReplicatedState s;
  s.gate = router_.gate_state(moments);
  s.selection_bias = selection_bias_;
  if (shared_) {
    s.shared = shared_->state(moments);
    s.shared_gate = shared_->gate_state(moments);
  }
  return s;
}

void EpLayer::set_replicated_state(const ReplicatedState& s) {
  router_.set_gate_state(s.gate);
  if (!s.selection_bias.empty()) {
    selection_bias_ = s.selection_bias;
    router_.set_selection_bias(selection_bias_);
  }
  if (shared_) shared_->set_state(s.shared, s.shared_gate);
}

void EpLayer::update_selection_bias(double rate) {
  MOE_CHECK(cfg_.global_counts, "bias update on a layer built without global_counts");
  if (rate <= 0) return;
  if (selection_bias_.empty()) selection_bias_.assign(cfg_.num_experts, 0.0f);
  ep::update_selection_bias(selection_bias_, counts_, rate);
  router_.set_selection_bias(selection_bias_);
}

void EpLayer::forward(const void* x, int64_t T, int64_t token_begin, void* out) {
  const int K = cfg_.top_k;
  x_ = x;
  stats_ = {};

  double t0 = now_seconds();
  router_.forward(x, T);
  be_.synchronize();
  if (cfg_.global_counts) gather_counts();
  double t1 = now_seconds();
  stats_.router = t1 - t0;

  be_.select_replicas(T, K, cfg_.num_experts,
                      {.topk_idx = router_.kept_idx(), .token_begin = token_begin, .log2phy = log2phy_.as<int32_t>(),
                       .logcnt = logcnt_.as<int32_t>(), .max_replicas = map_.max_replicas,
                       .topk_slot = topk_slot_.as<int32_t>()});
  const DispatchHandle& h = dispatcher_->dispatch(x, T, topk_slot_.as<int32_t>(), router_.topk_weight());
  handle_ = &h;
  reserve_rows(h.num_recv_rows());
  t0 = now_seconds();
  stats_.dispatch = t0 - t1;

  experts_->forward(h.recv_rows(), h.num_recv_rows(), h.recv_slot(), h.recv_weight(), combined_.get());
  for (int64_t n : experts_->expert_rows()) stats_.computed_pairs += n;
  t1 = now_seconds();
  stats_.expert = t1 - t0;

  dispatcher_->combine(h, combined_.get(), out);
  be_.synchronize();
  t0 = now_seconds();
  stats_.combine = t0 - t1;
  if (shared_) {  // on the rank's own tokens: counted as expert time
    shared_->forward(x, T, out);
    be_.synchronize();
    stats_.expert += now_seconds() - t0;
  }
  stats_.transfer = dispatcher_->stats();
}

void EpLayer::backward(const void* grad_out, void* grad_x) {
  MOE_CHECK(cfg_.train, "backward on a layer built without train = true");
  MOE_CHECK(handle_, "backward called before forward");
  const int64_t T = router_.num_tokens();
  const double t0 = now_seconds();
  const void* grad_rows = dispatcher_->combine_backward(*handle_, grad_out);
  const double t1 = now_seconds();
  // The received rows' gradients overwrite their combined outputs (no longer needed).
  experts_->backward(grad_rows, combined_.get(), cfg_.dtype, grad_pair_weight_.as<float>());
  be_.synchronize();
  stats_.expert_backward = now_seconds() - t1;
  dispatcher_->dispatch_backward(*handle_, combined_.get(), grad_pair_weight_.as<float>(), grad_x32_.as<float>(),
                                grad_topk_weight_.as<float>());
  router_.backward(x_, grad_topk_weight_.as<float>(), grad_x32_.as<float>(), balance_terms());
  if (shared_) shared_->backward(grad_out, grad_x32_.as<float>());
  be_.synchronize();
  all_reduce_replicated_grads();
  reduce_replica_grads();
  be_.convert(grad_x32_.get(), DType::kF32, grad_x, cfg_.dtype, T * cfg_.hidden);
  be_.synchronize();
  stats_.backward = now_seconds() - t0;
  stats_.transfer = dispatcher_->stats();
}

// The router's and the shared experts' gradients, summed over ranks in rank order.
void EpLayer::all_reduce_replicated_grads() {
  data_.all_reduce_sum(router_.grad_gate(), static_cast<size_t>(cfg_.num_experts) * cfg_.hidden, deadline());
  if (!shared_) return;
  data_.all_reduce_sum(shared_->grad_w13(), shared_->w13_size(), deadline());
  data_.all_reduce_sum(shared_->grad_w2(), shared_->w2_size(), deadline());
  if (shared_->gate_size()) data_.all_reduce_sum(shared_->grad_gate(), shared_->gate_size(), deadline());
}

// Replicas of one expert end with the same gradient bits: the primary (first
// replica) sums g_0 + g_1 + ... in replica order and sends the sum back, and to
// the expert's shadows while a rebalance is staged. Experts are handled in
// increasing id on every rank, and within an expert all traffic is between the
// primary and its replicas and shadows, so the blocking sends and receives cannot
// wait on each other in a cycle.
void EpLayer::reduce_replica_grads() {
  const size_t n = 2 * static_cast<size_t>(cfg_.ffn_hidden) * cfg_.hidden + static_cast<size_t>(cfg_.hidden) * cfg_.ffn_hidden;
  reduce_tmp_.resize(2 * n);
  for (int e = 0; e < cfg_.num_experts; ++e) {
    const bool shadows = staged_ && !staged_->shadows_of(e).empty();
    if (map_.logcnt[e] >= 2 || shadows) reduce_replica_grad(e, reduce_tmp_.data(), reduce_tmp_.data() + n);
  }
}

// One expert: acc and msg hold [w13 grad | w2 grad] of one replica each.
// Recipient k of the expert (tags): replicas 0 .. X-1, then its shadows.
void EpLayer::reduce_replica_grad(int e, float* acc, float* msg) {
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden;
  const size_t n13 = 2 * I * H, n2 = H * I, n = n13 + n2;
  const int me = comm_.rank(), S = map_.slots_per_rank;
  const int recipients = map_.max_replicas + (staged_ ? staged_->max_shadows() : 0);
  auto load = [&](int32_t slot, float* dst) {  // backend -> host
    be_.copy_to_host(dst, experts_->grad_w13() + static_cast<size_t>(slot % S) * n13, 4 * n13);
    be_.copy_to_host(dst + n13, experts_->grad_w2() + static_cast<size_t>(slot % S) * n2, 4 * n2);
  };
  auto store = [&](const float* src, int32_t slot) {  // host -> backend
    be_.copy_to_device(experts_->grad_w13() + static_cast<size_t>(slot % S) * n13, src, 4 * n13);
    be_.copy_to_device(experts_->grad_w2() + static_cast<size_t>(slot % S) * n2, src + n13, 4 * n2);
  };
  auto tag = [&](size_t k, int phase) {
    return opts_.tag_base + static_cast<uint32_t>(((static_cast<uint64_t>(e) * recipients + k) * 2 + phase) & 0xffffff);
  };
  const std::vector<int32_t> reps = map_.replicas(e);
  const std::vector<int> no_shadows;
  const std::vector<int>& shadows = staged_ ? staged_->shadows_of(e) : no_shadows;
  const int primary = map_.rank_of_slot(reps[0]);
  if (me == primary) {
    load(reps[0], acc);
    for (size_t i = 1; i < reps.size(); ++i) {
      const int owner = map_.rank_of_slot(reps[i]);
      if (owner == me) load(reps[i], msg);
      else comm_.recv(owner, msg, 4 * n, tag(i, 0), deadline());
      for (size_t j = 0; j < n; ++j) acc[j] += msg[j];
    }
    for (size_t i = 0; i < reps.size(); ++i) {
      const int owner = map_.rank_of_slot(reps[i]);
      if (owner == me) store(acc, reps[i]);
      else comm_.send(owner, acc, 4 * n, tag(i, 1), deadline());
    }
    for (size_t j = 0; j < shadows.size(); ++j) {  // a shadow never sits on a rank that hosts its expert
      const int to = staged_->copies()[shadows[j]].to_rank;
      comm_.send(to, acc, 4 * n, tag(map_.max_replicas + j, 1), deadline());
    }
    return;
  }
  for (size_t i = 1; i < reps.size(); ++i) {
    if (map_.rank_of_slot(reps[i]) != me) continue;
    load(reps[i], msg);
    comm_.send(primary, msg, 4 * n, tag(i, 0), deadline());
  }
  for (size_t i = 1; i < reps.size(); ++i) {
    if (map_.rank_of_slot(reps[i]) != me) continue;
    comm_.recv(primary, msg, 4 * n, tag(i, 1), deadline());
    store(msg, reps[i]);
  }
  for (size_t j = 0; j < shadows.size(); ++j)
    if (staged_->gains(shadows[j]))
      comm_.recv(primary, staged_->shadow_gradient(shadows[j]), 4 * n, tag(map_.max_replicas + j, 1), deadline());
}

model::LayerWeights EpLayer::primary_weights() const {
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, E = cfg_.num_experts, n13 = 2 * I * H, n2 = H * I;
  model::LayerWeights w;
  w.gate.resize(E * H);
  router_.copy_gate(w.gate.data());
  w.selection_bias = selection_bias_;
  if (shared_) shared_->copy_weights(w);
  w.w13.assign(E * n13, 0.0f);
  w.w2.assign(E * n2, 0.0f);
  const int me = comm_.rank();
  for (int e = 0; e < static_cast<int>(E); ++e) {
    const int32_t primary = map_.replicas(e)[0];
    if (map_.rank_of_slot(primary) == me)
      experts_->copy_weights(primary % map_.slots_per_rank, w.w13.data() + e * n13, w.w2.data() + e * n2);
  }
  return w;
}

void EpLayer::stage(const ExpertMap& next, std::vector<ExpertCopyPlan> copies, bool adam) {
  MOE_CHECK(next.num_experts == cfg_.num_experts && next.num_ranks == map_.num_ranks, "rebalance: the new map places ",
            next.num_experts, " experts on ", next.num_ranks, " ranks, the layer ", cfg_.num_experts, " on ",
            map_.num_ranks);
  adam_ = adam && cfg_.train;
  staged_ = std::make_unique<StagedExperts>(next, std::move(copies), comm_.rank(), cfg_, adam_, opts_.tag_base);
  staged_->start(*experts_, map_, comm_);
  if (next.slots_per_rank == map_.slots_per_rank) return;
  // Another slot count: the new stage and dispatcher are built (and their pages
  // faulted in) now, while copies stream, not at the switch.
  next_experts_ = std::make_unique<ExpertStage>(cfg_, next.slots_per_rank, be_);
  next_experts_->reserve(std::max<int64_t>(recv_capacity_, cfg_.max_tokens));
  next_experts_->touch(adam_);
  next_dispatcher_ = std::make_unique<Dispatcher>(
      dispatcher_config(cfg_, next), data_, be_,
      DispatcherOptions{.timeout = opts_.timeout, .isolate_transport_timing = opts_.isolate_transport_timing});
}

bool EpLayer::staged_ready() {
  MOE_CHECK(staged_, "rebalance: nothing is staged");
  return staged_->ready(comm_, be_);
}

void EpLayer::drop_staged() {
  staged_.reset();
  next_experts_.reset();
  next_dispatcher_.reset();
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
  MOE_CHECK(staged_, "rebalance: nothing is staged");
  const ExpertMap next = staged_->next();
  if (next_experts_) switch_to_new_stage(next);
  else switch_in_place(next);
  install_map(next);
  staged_.reset();
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
    st.resize(cfg_.hidden, cfg_.ffn_hidden, adam_);
    experts_->export_slot(old_slot_of(e), st);
    moves.emplace_back(s, std::move(st));
  }
  for (const auto& [s, st] : moves) experts_->import_slot(s, st);
  for (int s = 0; s < next.slots_per_rank; ++s) {
    const int e = next.expert_at(me, s);
    if (e >= 0 && e != map_.expert_at(me, s) && old_slot_of(e) < 0) experts_->import_slot(s, staged_->gained_state(s));
  }
}

// Another slot count: the stage built at staging takes every slot.
void EpLayer::switch_to_new_stage(const ExpertMap& next) {
  const int me = comm_.rank();
  for (int s = 0; s < next.slots_per_rank; ++s) {
    const int e = next.expert_at(me, s);
    if (e < 0) continue;
    const int old = old_slot_of(e);
    if (old >= 0) next_experts_->copy_slot(*experts_, old, s);
    else next_experts_->import_slot(s, staged_->gained_state(s));
  }
  experts_ = std::move(next_experts_);
  dispatcher_ = std::move(next_dispatcher_);
}

void EpLayer::optimizer_step(const kernels::OptimizerConfig& cfg, int64_t step) {
  router_.apply_update(cfg, step);
  experts_->apply_update(cfg, step);
  if (shared_) shared_->apply_update(cfg, step);
  if (staged_) staged_->optimizer_step(cfg, step, be_);
  be_.synchronize();
}

const float* EpLayer::grad_w13(int local_slot) const {
  return experts_->grad_w13() + static_cast<size_t>(local_slot) * 2 * cfg_.ffn_hidden * cfg_.hidden;
}

const float* EpLayer::grad_w2(int local_slot) const {
  return experts_->grad_w2() + static_cast<size_t>(local_slot) * cfg_.hidden * cfg_.ffn_hidden;
}

EpGrads EpLayer::copy_grads() const {
  MOE_CHECK(cfg_.train, "weight gradients of a layer built without train = true");
  auto host = [&](const float* p, size_t n) { return kernels::to_host<float>(be_, p, p ? n : 0); };
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, S = map_.slots_per_rank;
  EpGrads g;
  g.gate = host(grad_gate(), cfg_.num_experts * H);
  g.w13 = host(experts_->grad_w13(), S * 2 * I * H);
  g.w2 = host(experts_->grad_w2(), S * H * I);
  if (shared_) {
    g.shared_w13 = host(shared_->grad_w13(), shared_->w13_size());
    g.shared_w2 = host(shared_->grad_w2(), shared_->w2_size());
    g.shared_gate = host(shared_->grad_gate(), shared_->gate_size());
  }
  return g;
}

}  // namespace moe::ep
