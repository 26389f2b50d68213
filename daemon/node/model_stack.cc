#include "moe/node/model_stack.h"

#include <algorithm>
#include <cmath>

#include "moe/base/clock.h"
#include "moe/layer_spec/job_layers.h"

namespace moe::node {

using kernels::DType;

namespace {

// The teacher's layers: forward only, no balancing statistics (its spec has none).
ep::MoeLayerConfig teacher_config(const v1::JobSpec& teacher_spec) {
  ep::LayerSpec s = layer_spec::layer_spec(teacher_spec);
  s.train = false;
  return ep::layer_config(s);
}

}  // namespace

ModelStack::ModelStack(const v1::JobSpec& spec, const std::vector<moe::ExpertMap>& maps, int rank, int world,
                       transport::Communicator& comm, kernels::Backend& be, kernels::ThreadPool& pool,
                       std::chrono::milliseconds timeout, transport::Communicator* data_comm)
    : spec_(spec),
      comm_(comm),
      data_comm_(data_comm),
      be_(be),
      pool_(pool),
      timeout_(timeout),
      rank_(rank),
      world_(world),
      T_(spec.tokens_per_rank()),
      H_(spec.hidden()),
      dt_(layer_spec::job_dtype(spec)) {
  const int L = spec.layers();
  MOE_CHECK(static_cast<int>(maps.size()) == L, "start: ", maps.size(), " placement maps for ", L, " layers");
  const bool train = spec.mode() == v1::JobSpec::train;
  const ep::MoeLayerConfig cfg = layer_spec::layer_config(spec);
  const v1::JobSpec teacher_spec = layer_spec::teacher_of(spec);
  const ep::MoeLayerConfig teacher_cfg = teacher_config(teacher_spec);
  for (int l = 0; l < L; ++l) {
    const std::vector<bool> needed = maps[l].hosted(rank_);
    layers_.push_back(std::make_unique<ep::EpLayer>(cfg, maps[l], comm, be, layer_options(l)));
    layers_.back()->set_weights(layer_spec::layer_weights(spec, l, needed, &pool_));
    if (!train) continue;
    teacher_.push_back(std::make_unique<ep::EpLayer>(teacher_cfg, maps[l], comm, be, layer_options(l)));
    teacher_.back()->set_weights(layer_spec::layer_weights(teacher_spec, l, needed, &pool_));
  }
  const size_t bytes = T_ * H_ * kernels::dtype_size(dt_) + 1;
  for (int l = 0; l <= L; ++l) xs_.emplace_back(be, bytes);
  out_ = kernels::Buffer(be, bytes);
  if (train) {
    grad_ = kernels::Buffer(be, bytes);
    grad_x_ = kernels::Buffer(be, bytes);
    xt_ = kernels::Buffer(be, bytes);
  }
  snaps_.resize(L);
  loads_.assign(L, std::vector<float>(spec.experts(), 0.0f));
  opt_ = layer_spec::optimizer_config(spec);
}

ep::EpOptions ModelStack::layer_options(int l) const {
  return {.timeout = timeout_,
          .tag_base = static_cast<uint32_t>(l) << 24,
          .overlap_chunks = spec_.overlap_chunks(),
          .exact_replica_grads = spec_.exact_replica_grads(),
          .dispatch_wire = layer_spec::wire(spec_.dispatch_wire()),
          .combine_wire = layer_spec::wire(spec_.combine_wire()),
          .data_comm = data_comm_};
}

std::vector<uint8_t> ModelStack::host_bytes(const kernels::Buffer& b) const {
  return kernels::to_host<uint8_t>(be_, b.get(), T_ * H_ * kernels::dtype_size(dt_));
}

void ModelStack::stage(const std::vector<ExpertMap>& next, const std::vector<std::vector<ExpertCopy>>& copies) {
  MOE_CHECK(static_cast<int>(next.size()) == num_layers() && static_cast<int>(copies.size()) == num_layers(),
            "rebalance: ", next.size(), " maps for ", num_layers(), " layers");
  const bool adam = spec_.mode() == v1::JobSpec::train && spec_.optimizer() != v1::JobSpec::sgd;
  for (int l = 0; l < num_layers(); ++l) layers_[l]->stage(next[l], copies[l], adam);
  if (teacher_.empty()) return;
  const v1::JobSpec teacher_spec = layer_spec::teacher_of(spec_);
  const ep::MoeLayerConfig teacher_cfg = teacher_config(teacher_spec);
  staged_teacher_.clear();
  for (int l = 0; l < num_layers(); ++l) {
    staged_teacher_.push_back(std::make_unique<ep::EpLayer>(teacher_cfg, next[l], comm_, be_, layer_options(l)));
    staged_teacher_.back()->set_weights(layer_spec::layer_weights(teacher_spec, l, next[l].hosted(rank_), &pool_));
  }
}

bool ModelStack::staged_ready() {
  bool all = true;
  for (auto& layer : layers_) all &= layer->staged_ready();  // every layer progresses
  return all;
}

void ModelStack::switch_to_staged() {
  for (auto& layer : layers_) layer->switch_to_staged();
  if (!staged_teacher_.empty()) teacher_ = std::move(staged_teacher_);
  staged_teacher_.clear();
}

void ModelStack::drop_staged() {
  for (auto& layer : layers_) layer->drop_staged();
  staged_teacher_.clear();
}

int64_t ModelStack::staged_bytes_received() const {
  int64_t bytes = 0;
  for (const auto& layer : layers_) bytes += layer->staged_bytes_received();
  return bytes;
}

std::vector<model::LayerWeights> ModelStack::weights_in_use(int step, transport::Deadline deadline) const {
  std::vector<model::LayerWeights> all;
  const bool trained = spec_.mode() == v1::JobSpec::train && step > 0;
  for (int l = 0; l < num_layers(); ++l) {
    const model::LayerWeights spec_w = layer_spec::layer_weights(spec_, l, std::vector<bool>(spec_.experts(), !trained));
    if (!trained) {
      all.push_back(ep::weights_as_used(spec_w, dt_));
      all.back().selection_bias = layers_[l]->selection_bias();  // moved by bias updates
      continue;
    }
    model::LayerWeights w = layers_[l]->primary_weights();  // router, bias and shared experts: the same everywhere
    comm_.all_reduce_sum(w.w13.data(), w.w13.size(), deadline);  // x + 0 = x: each expert's bits
    comm_.all_reduce_sum(w.w2.data(), w.w2.size(), deadline);
    w.logit_bias = spec_w.logit_bias;
    all.push_back(std::move(w));
  }
  return all;
}

// Layer l's inputs, output and routing as this step saw them, to host memory.
void ModelStack::capture_forward(int l) {
  const ep::EpLayer& layer = *layers_[l];
  const size_t pairs = T_ * spec_.top_k();
  LayerSnapshot& s = snaps_[l];
  s.x = host_bytes(xs_[l]);
  s.out = host_bytes(out_);
  s.topk_idx = kernels::to_host<int32_t>(be_, layer.topk_idx(), pairs);
  s.kept_idx = kernels::to_host<int32_t>(be_, layer.kept_idx(), pairs);
  s.topk_weight = kernels::to_host<float>(be_, layer.topk_weight(), pairs);
}

void ModelStack::forward(int step, StepReport& report, bool capture) {
  const int K = spec_.top_k();
  const size_t n = T_ * H_;
  const double t0 = now_seconds();
  const std::vector<uint8_t> x = model::to_storage(layer_spec::step_inputs(spec_, rank_, step, pool_), dt_);
  be_.copy_to_device(xs_[0].get(), x.data(), n * kernels::dtype_size(dt_));
  report.set_inputs_seconds(now_seconds() - t0);
  for (int l = 0; l < num_layers(); ++l) {
    ep::EpLayer& layer = *layers_[l];
    layer.forward(xs_[l].get(), T_, token_begin(), out_.get());
    report.add_forward(l, layer, T_, K);
    const v1::ExpertTokens& kept = report.stats().expert_tokens(l);  // counted by the report
    for (int e = 0; e < kept.tokens_size(); ++e) loads_[l][e] += static_cast<float>(kept.tokens(e));
    if (capture) capture_forward(l);
    be_.copy(xs_[l + 1].get(), xs_[l].get(), n * kernels::dtype_size(dt_));  // the residual stream
    be_.add(xs_[l + 1].get(), out_.get(), dt_, static_cast<int64_t>(n));
  }
  be_.synchronize();
}

void ModelStack::backward(StepReport& report, bool capture) {
  const size_t n = T_ * H_;
  const double t_teacher = now_seconds();
  be_.copy(xt_.get(), xs_[0].get(), n * kernels::dtype_size(dt_));
  for (auto& teacher : teacher_) {
    teacher->forward(xt_.get(), T_, token_begin(), out_.get());
    report.note_chunks(teacher->stats().transfer.chunks);
    be_.add(xt_.get(), out_.get(), dt_, static_cast<int64_t>(n));
  }
  report.set_teacher_seconds(now_seconds() - t_teacher);
  const std::vector<float> y = model::from_storage(host_bytes(xs_.back()).data(), n, dt_);
  const std::vector<float> yt = model::from_storage(host_bytes(xt_).data(), n, dt_);
  const double norm = static_cast<double>(T_) * world_ * H_;
  double loss = 0;
  std::vector<float> g(n);
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(y[i]) - yt[i];
    loss += d * d;
    g[i] = static_cast<float>(2.0 * d / norm);
  }
  report.set_loss(loss / norm);
  const double t0 = now_seconds();
  const std::vector<uint8_t> g_stored = model::to_storage(g, dt_);
  be_.copy_to_device(grad_.get(), g_stored.data(), n * kernels::dtype_size(dt_));
  for (int l = num_layers() - 1; l >= 0; --l) {
    layers_[l]->backward(grad_.get(), grad_x_.get());
    report.add_backward(l, *layers_[l]);
    report.add_balance_losses(layers_[l]->balance_losses());
    if (capture) {
      snaps_[l].grad_out = host_bytes(grad_);
      snaps_[l].grad_x = host_bytes(grad_x_);
      snaps_[l].grads = layers_[l]->copy_grads();
    }
    be_.add(grad_.get(), grad_x_.get(), dt_, static_cast<int64_t>(n));
  }
  be_.synchronize();
  report.set_backward_seconds(now_seconds() - t0);
}

int ModelStack::first_nonfinite_router_gradient() const {
  const size_t n = static_cast<size_t>(spec_.experts()) * H_;
  for (int l = 0; l < num_layers(); ++l) {
    const std::vector<float> g = kernels::to_host<float>(be_, layers_[l]->grad_gate(), n);
    if (!std::all_of(g.begin(), g.end(), [](float v) { return std::isfinite(v); })) return l;
  }
  return -1;
}

void ModelStack::update_selection_bias() {
  if (spec_.bias_update_rate() <= 0) return;
  bias_before_.clear();
  for (auto& layer : layers_) {
    bias_before_.push_back(layer->selection_bias());
    layer->update_selection_bias(spec_.bias_update_rate());
  }
}

void ModelStack::undo_selection_bias() {
  for (size_t l = 0; l < bias_before_.size(); ++l) layers_[l]->set_selection_bias(bias_before_[l]);
  bias_before_.clear();
}

void ModelStack::optimize(int step, StepReport& report) {
  const double t0 = now_seconds();
  for (auto& layer : layers_) layer->optimizer_step(opt_, step + 1);
  report.set_optimizer_seconds(now_seconds() - t0);
}

}  // namespace moe::node
