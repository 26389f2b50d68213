#include "moe/ep/ep_layer.h"

#include <algorithm>
#include <cstring>

#include "moe/base/check.h"
#include "moe/base/clock.h"

namespace moe::ep {

using kernels::Buffer;


EpLayer::EpLayer(const MoeLayerConfig& cfg, const ExpertMap& map, transport::Communicator& comm,
                 kernels::Backend& be, const EpOptions& options)
    : cfg_(cfg),
      map_(map),
      comm_(comm),
      data_(options.data_comm ? *options.data_comm : comm),
      be_(be),
      opts_(options),
      router_(cfg, be),
      dispatcher_(make_dispatcher(map)),
      experts_(std::make_unique<ExpertStage>(cfg, map.slots_per_rank, be)),
      replica_grads_(cfg, comm, be, options.tag_base, options.timeout, options.exact_replica_grads) {
  MOE_CHECK(map.num_experts == cfg.num_experts, "ep layer: the map places ", map.num_experts,
            " experts, the layer has ", cfg.num_experts);
  const size_t T = cfg.max_tokens, K = cfg.top_k, H = cfg.hidden;
  install_map(map);
  scratch_.topk_slot = Buffer(be_, 4 * T * K);
  if (cfg.train) {
    scratch_.grad_topk_weight = Buffer(be_, 4 * T * K);
    scratch_.grad_x32 = Buffer(be_, 4 * T * H);
  }
  reserve_rows(T);  // a first guess; grows when a step receives more
  if (cfg.shared_ffn_hidden > 0) shared_ = std::make_unique<SharedExperts>(cfg, be);
  if (cfg.global_counts) balance_.counts_dev = Buffer(be_, 4 * static_cast<size_t>(cfg.num_experts));
}

// The dispatcher of a layer placed by `map`, on the backend-memory communicator.
std::unique_ptr<Dispatcher> EpLayer::make_dispatcher(const ExpertMap& map) const {
  const DispatcherConfig dc{.hidden = cfg_.hidden,
                            .top_k = cfg_.top_k,
                            .dtype = cfg_.dtype,
                            .max_tokens = cfg_.max_tokens,
                            .num_ranks = map.num_ranks,
                            .slots_per_rank = map.slots_per_rank,
                            .train = cfg_.train,
                            .dispatch_wire = opts_.dispatch_wire,
                            .combine_wire = opts_.combine_wire};
  return std::make_unique<Dispatcher>(dc, data_, be_,
                                      DispatcherOptions{.timeout = opts_.timeout,
                                                        .isolate_transport_timing = opts_.isolate_transport_timing,
                                                        .overlap_chunks = opts_.overlap_chunks});
}

// The replica tables the router's replica choice reads.
void EpLayer::install_map(const ExpertMap& map) {
  map_ = map;
  log2phy_ = Buffer(be_, 4 * map.log2phy.size());
  logcnt_ = Buffer(be_, 4 * map.logcnt.size());
  be_.copy_to_device(log2phy_.get(), map.log2phy.data(), 4 * map.log2phy.size());
  be_.copy_to_device(logcnt_.get(), map.logcnt.data(), 4 * map.logcnt.size());
}

// Buffers of the received rows: in train mode their per-pair weight gradients.
void EpLayer::reserve_rows(int64_t n) {
  if (n <= scratch_.recv_capacity) return;
  scratch_.recv_capacity = n;
  if (cfg_.train) scratch_.grad_pair_weight = Buffer(be_, 4 * static_cast<size_t>(n) * cfg_.top_k);
  experts_->reserve(n);
}

// The results of the received pairs, a row each (and their input gradients).
void EpLayer::reserve_pairs(int64_t pairs) {
  if (pairs <= scratch_.pair_capacity) return;
  scratch_.pair_capacity = pairs;
  scratch_.combined = Buffer(be_, static_cast<size_t>(pairs) * kernels::dtype_size(cfg_.dtype) * cfg_.hidden);
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
  balance_.selection_bias = local.selection_bias;
}

// c_e and T_g of the step over every rank (counts are integers: the float sum is exact).
void EpLayer::gather_counts() {
  balance_.counts = router_.expert_counts();
  comm_.all_reduce_sum(balance_.counts.data(), balance_.counts.size(), deadline());
  double pairs = 0;
  for (float c : balance_.counts) pairs += c;
  balance_.global_tokens = pairs / cfg_.top_k;
  be_.copy_to_device(balance_.counts_dev.get(), balance_.counts.data(), 4 * balance_.counts.size());
  if (!cfg_.train || (cfg_.aux_loss_coeff == 0 && cfg_.z_loss_coeff == 0)) return;
  std::vector<float> logits, scores;
  router_.copy_logits(logits, scores);
  balance_.losses = ep::balance_losses(cfg_.routing(), cfg_.aux_loss_coeff, cfg_.z_loss_coeff, logits, scores,
                               router_.num_tokens(), balance_.counts, balance_.global_tokens);
}

RouterBalance EpLayer::balance_terms() const {
  if (!cfg_.global_counts) return {};
  return {.aux_scale = static_cast<float>(aux_loss_scale(cfg_.aux_loss_coeff, cfg_.num_experts, cfg_.top_k, balance_.global_tokens)),
          .z_scale = static_cast<float>(z_loss_scale(cfg_.z_loss_coeff, balance_.global_tokens)),
          .counts = balance_.counts_dev.as<float>()};
}

EpLayer::ReplicatedState EpLayer::replicated_state(bool moments) const {
  ReplicatedState s;
  s.gate = router_.gate_state(moments);
  s.selection_bias = balance_.selection_bias;
  if (shared_) {
    s.shared = shared_->state(moments);
    s.shared_gate = shared_->gate_state(moments);
  }
  return s;
}

void EpLayer::set_replicated_state(const ReplicatedState& s) {
  router_.set_gate_state(s.gate);
  if (!s.selection_bias.empty()) {
    balance_.selection_bias = s.selection_bias;
    router_.set_selection_bias(balance_.selection_bias);
  }
  if (shared_) shared_->set_state(s.shared, s.shared_gate);
}

void EpLayer::set_selection_bias(std::vector<float> bias) {
  MOE_CHECK(bias.empty() || static_cast<int>(bias.size()) == cfg_.num_experts, "selection bias: ", bias.size(),
            " values for ", cfg_.num_experts, " experts");
  if (bias.empty() && balance_.selection_bias.empty()) return;
  balance_.selection_bias = std::move(bias);
  router_.set_selection_bias(balance_.selection_bias.empty() ? std::vector<float>(cfg_.num_experts, 0.0f) : balance_.selection_bias);
}

void EpLayer::update_selection_bias(double rate) {
  MOE_CHECK(cfg_.global_counts, "bias update on a layer built without global_counts");
  if (rate <= 0) return;
  if (balance_.selection_bias.empty()) balance_.selection_bias.assign(cfg_.num_experts, 0.0f);
  ep::update_selection_bias(balance_.selection_bias, balance_.counts, rate);
  router_.set_selection_bias(balance_.selection_bias);
}

// The received rows as the experts see them: chunk runs, results a row per pair,
// weight gradients in source order.
RowLayout EpLayer::row_layout(const DispatchHandle& h) {
  return {.row_order = h.row_order(), .pair_row_offset = h.recv_pair_offset(), .source_key = h.source_key()};
}

void EpLayer::forward(const void* x, int64_t T, int64_t token_begin, void* out) {
  const int K = cfg_.top_k;
  last_.x = x;
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
                       .topk_slot = scratch_.topk_slot.as<int32_t>()});
  const DispatchHandle& h = dispatcher_->dispatch(x, T, scratch_.topk_slot.as<int32_t>(), router_.topk_weight());
  last_.handle = &h;
  reserve_rows(h.num_recv_rows());
  t0 = now_seconds();
  stats_.dispatch = t0 - t1;
  if (dispatcher_->chunks() > 1) {
    forward_chunks(h, out);
  } else {
    reserve_pairs(h.num_recv_pairs());
    experts_->forward(h.recv_rows(), h.num_recv_rows(), h.recv_slot(), h.recv_weight(), scratch_.combined.get(),
                      row_layout(h));
    for (int64_t n : experts_->expert_rows()) stats_.computed_pairs += n;
    t1 = now_seconds();
    stats_.expert = t1 - t0;
    dispatcher_->combine(h, scratch_.combined.get(), out);
    be_.synchronize();
    stats_.combine = now_seconds() - t1;
  }
  dispatcher_->note_compute(stats_.expert,
                            static_cast<double>(stats_.computed_pairs) / std::max(1, map_.slots_per_rank));
  t0 = now_seconds();
  if (shared_) {  // on the rank's own tokens: counted as expert time
    shared_->forward(x, T, out);
    be_.synchronize();
    stats_.expert += now_seconds() - t0;
  }
  stats_.transfer = dispatcher_->stats();
}

// The experts chunk by chunk while the dispatcher moves the next chunk's rows
// and the last one's results (docs/layer.md#overlap): every row's pairs are laid
// out when the first chunk (with every row's slots) has arrived. Dispatch and
// combine time is what this thread waited for them.
void EpLayer::forward_chunks(const DispatchHandle& h, void* out) {
  for (int c = 0; c < dispatcher_->chunks(); ++c) {
    double t0 = now_seconds();
    const ChunkRows ch = dispatcher_->next_chunk();
    double t1 = now_seconds();
    stats_.dispatch += t1 - t0;
    if (c == 0) {
      reserve_pairs(h.num_recv_pairs());
      experts_->layout(h.recv_slot(), h.recv_weight(), h.num_recv_rows(), row_layout(h));
      for (int64_t n : experts_->expert_rows()) stats_.computed_pairs += n;
    }
    experts_->forward_rows(h.recv_rows(), ch.first_row, ch.num_rows, scratch_.combined.get());
    stats_.expert += now_seconds() - t1;
    dispatcher_->chunk_done(scratch_.combined.get());
  }
  const double t0 = now_seconds();
  dispatcher_->combine(h, scratch_.combined.get(), out);
  be_.synchronize();
  stats_.combine = now_seconds() - t0;
}

void EpLayer::backward(const void* grad_out, void* grad_x) {
  MOE_CHECK(cfg_.train, "backward on a layer built without train = true");
  MOE_CHECK(last_.handle, "backward called before forward");
  const int64_t T = router_.num_tokens();
  const double t0 = now_seconds();
  experts_backward(grad_out);
  dispatcher_->dispatch_backward(*last_.handle, scratch_.combined.get(), scratch_.grad_pair_weight.as<float>(), scratch_.grad_x32.as<float>(),
                                scratch_.grad_topk_weight.as<float>());
  router_.backward(last_.x, scratch_.grad_topk_weight.as<float>(), scratch_.grad_x32.as<float>(), balance_terms());
  if (shared_) shared_->backward(grad_out, scratch_.grad_x32.as<float>());
  be_.synchronize();
  all_reduce_replicated_grads();
  replica_grads_.run(map_, *experts_, next_.staged.get(),
                     {.x = last_.handle->recv_rows(),
                      .grad = last_.grad_rows,
                      .slot = last_.handle->recv_slot(),
                      .weight = last_.handle->recv_weight(),
                      .source_key = last_.handle->source_key(),
                      .num_rows = last_.handle->num_recv_rows()});
  be_.convert(scratch_.grad_x32.get(), DType::kF32, grad_x, cfg_.dtype, T * cfg_.hidden);
  be_.synchronize();
  stats_.backward = now_seconds() - t0;
  stats_.transfer = dispatcher_->stats();
}

// The grad rows to the experts and their gradients back, chunk by chunk as the
// forward ran (docs/layer.md#overlap): each chunk's dgrad while the next chunk's
// grad rows arrive and the last one's results leave, then the weight gradients
// (no transfer) while the last results are in flight. The received rows'
// gradients overwrite their combined outputs (no longer needed).
void EpLayer::experts_backward(const void* grad_out) {
  const void* grad_rows = last_.grad_rows = dispatcher_->combine_backward(*last_.handle, grad_out);
  float* grad_pair_weight = scratch_.grad_pair_weight.as<float>();
  if (dispatcher_->chunks() == 1) {
    const double t0 = now_seconds();
    experts_->backward(grad_rows, scratch_.combined.get(), cfg_.dtype, grad_pair_weight);
    be_.synchronize();
    stats_.expert_backward = now_seconds() - t0;
    return;
  }
  for (int c = 0; c < dispatcher_->chunks(); ++c) {
    const ChunkRows ch = dispatcher_->next_backward_chunk();
    const double t0 = now_seconds();
    experts_->backward_rows(grad_rows, ch.first_row, ch.num_rows, scratch_.combined.get(), cfg_.dtype, grad_pair_weight);
    stats_.expert_backward += now_seconds() - t0;
    dispatcher_->backward_chunk_done(scratch_.combined.get(), grad_pair_weight);
  }
  const double t0 = now_seconds();
  experts_->weight_grads();
  be_.synchronize();
  stats_.expert_backward += now_seconds() - t0;
}

// The router's and the shared experts' gradients, summed over ranks in rank order.
void EpLayer::all_reduce_replicated_grads() {
  data_.all_reduce_sum(router_.grad_gate(), static_cast<size_t>(cfg_.num_experts) * cfg_.hidden, deadline());
  if (!shared_) return;
  data_.all_reduce_sum(shared_->grad_w13(), shared_->w13_size(), deadline());
  data_.all_reduce_sum(shared_->grad_w2(), shared_->w2_size(), deadline());
  if (shared_->gate_size()) data_.all_reduce_sum(shared_->grad_gate(), shared_->gate_size(), deadline());
}

model::LayerWeights EpLayer::primary_weights() const {
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, E = cfg_.num_experts, n13 = 2 * I * H, n2 = H * I;
  model::LayerWeights w;
  w.gate.resize(E * H);
  router_.copy_gate(w.gate.data());
  w.selection_bias = balance_.selection_bias;
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

void EpLayer::optimizer_step(const kernels::OptimizerConfig& cfg, int64_t step) {
  router_.apply_update(cfg, step);
  experts_->apply_update(cfg, step);
  if (shared_) shared_->apply_update(cfg, step);
  if (next_.staged) next_.staged->optimizer_step(cfg, step, be_);
  be_.synchronize();
}

std::vector<GradSums::Tensor> EpLayer::grad_tensors() {
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, S = map_.slots_per_rank;
  std::vector<GradSums::Tensor> t = {{router_.grad_gate(), cfg_.num_experts * H},
                                     {experts_->grad_w13(), S * 2 * I * H},
                                     {experts_->grad_w2(), S * H * I}};
  if (shared_) {
    t.push_back({shared_->grad_w13(), shared_->w13_size()});
    t.push_back({shared_->grad_w2(), shared_->w2_size()});
    if (shared_->gate_size()) t.push_back({shared_->grad_gate(), shared_->gate_size()});
  }
  return t;
}

void EpLayer::accumulate_grads() {
  MOE_CHECK(cfg_.train, "gradients of a layer built without train = true");
  grad_sums_.add(be_, grad_tensors());
  if (next_.staged) next_.staged->add_pass_gradients();
  be_.synchronize();
}

bool EpLayer::load_accumulated_grads() {
  if (!grad_sums_.load(be_, grad_tensors())) return false;
  if (next_.staged) next_.staged->load_summed_gradients();
  be_.synchronize();
  return true;
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
