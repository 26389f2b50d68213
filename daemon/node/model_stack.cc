#include "moe/node/model_stack.h"

#include <algorithm>
#include <cmath>

#include "moe/base/clock.h"
#include "moe/layer_spec/job_layers.h"

namespace moe::node {

using kernels::DType;

ModelStack::ModelStack(const v1::JobSpec& spec, const std::vector<moe::ExpertMap>& maps, int rank, int world,
                       transport::Communicator& comm, kernels::Backend& be, kernels::ThreadPool& pool,
                       std::chrono::milliseconds timeout, transport::Communicator* data_comm,
                       std::unique_ptr<StepSource> source)
    : job_(spec),
      comm_(comm),
      data_comm_(data_comm),
      be_(be),
      pool_(pool),
      timeout_(timeout),
      rank_(rank),
      world_(world),
      T_(job_.tokens_per_rank),
      H_(job_.shape.hidden),
      dt_(job_.dtype) {
  const int L = job_.layers;
  MOE_CHECK(static_cast<int>(maps.size()) == L, "start: ", maps.size(), " placement maps for ", L, " layers");
  const ep::MoeLayerConfig cfg = layer_spec::layer_config(spec);
  for (int l = 0; l < L; ++l) {
    layers_.push_back(std::make_unique<ep::EpLayer>(cfg, maps[l], comm, be, layer_options(l)));
    layers_.back()->set_weights(layer_spec::layer_weights(spec, l, maps[l].hosted(rank_), &pool_));
  }
  if (!source) {
    LayerOptions options = [this](int l) { return layer_options(l); };
    source = job_.inputs.empty() ? std::make_unique<SyntheticSource>(job_, maps, rank_, comm, be, pool_, options)
                                 : std::make_unique<RecordedSource>(job_, maps, rank_, comm, be, pool_, options);
  }
  source_ = std::move(source);
  const size_t bytes = T_ * H_ * kernels::dtype_size(dt_) + 1;
  for (int l = 0; l <= L; ++l) xs_.emplace_back(be, bytes);
  out_ = kernels::Buffer(be, bytes);
  if (job_.train) {
    grad_ = kernels::Buffer(be, bytes);
    grad_x_ = kernels::Buffer(be, bytes);
    targets_ = kernels::Buffer(be, bytes);
  }
  snaps_.resize(L);
  loads_.assign(L, std::vector<float>(job_.shape.num_experts, 0.0f));
  opt_ = layer_spec::optimizer_config(spec);
}

ep::EpOptions ModelStack::layer_options(int l) const {
  return {.timeout = timeout_,
          .tag_base = static_cast<uint32_t>(l) << 24,
          .overlap_chunks = job_.overlap_chunks,
          .exact_replica_grads = job_.exact_replica_grads,
          .dispatch_wire = job_.dispatch_wire,
          .combine_wire = job_.combine_wire,
          .data_comm = data_comm_};
}

std::vector<uint8_t> ModelStack::host_bytes(const kernels::Buffer& b) const {
  return kernels::to_host<uint8_t>(be_, b.get(), T_ * H_ * kernels::dtype_size(dt_));
}

void ModelStack::stage(const std::vector<ExpertMap>& next, const std::vector<std::vector<ExpertCopy>>& copies) {
  MOE_CHECK(static_cast<int>(next.size()) == num_layers() && static_cast<int>(copies.size()) == num_layers(),
            "rebalance: ", next.size(), " maps for ", num_layers(), " layers");
  for (int l = 0; l < num_layers(); ++l) layers_[l]->stage(next[l], copies[l], job_.adam);
  source_->stage(next);
}

bool ModelStack::staged_ready() {
  bool all = true;
  for (auto& layer : layers_) all &= layer->staged_ready();  // every layer progresses
  return all;
}

void ModelStack::switch_to_staged() {
  for (auto& layer : layers_) layer->switch_to_staged();
  source_->switch_to_staged();
}

void ModelStack::drop_staged() {
  for (auto& layer : layers_) layer->drop_staged();
  source_->drop_staged();
}

int64_t ModelStack::staged_bytes_received() const {
  int64_t bytes = 0;
  for (const auto& layer : layers_) bytes += layer->staged_bytes_received();
  return bytes;
}

std::vector<model::LayerWeights> ModelStack::weights_in_use(int step, transport::Deadline deadline) const {
  std::vector<model::LayerWeights> all;
  // Not the spec's (nor the HF files'): trained since, or read from a checkpoint.
  const bool trained = (job_.train && step > 0) || !job_.resume.empty();
  for (int l = 0; l < num_layers(); ++l) {
    const model::LayerWeights spec_w = layer_spec::layer_weights(job_.spec, l, std::vector<bool>(job_.shape.num_experts, !trained));
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
  const size_t pairs = T_ * job_.top_k;
  LayerSnapshot& s = snaps_[l];
  s.x = host_bytes(xs_[l]);
  s.out = host_bytes(out_);
  s.topk_idx = kernels::to_host<int32_t>(be_, layer.topk_idx(), pairs);
  s.kept_idx = kernels::to_host<int32_t>(be_, layer.kept_idx(), pairs);
  s.topk_weight = kernels::to_host<float>(be_, layer.topk_weight(), pairs);
}

void ModelStack::forward(int step, StepReport& report, bool capture) {
  const int K = job_.top_k;
  const size_t n = T_ * H_;
  source_->inputs(step, xs_[0], report);
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

size_t ModelStack::serve_rows_in(const std::vector<uint8_t>& x, int64_t T) {
  MOE_CHECK(T >= 0 && T <= T_, "serve: ", T, " rows in a step of at most ", T_);
  const size_t bytes = T * H_ * kernels::dtype_size(dt_);
  MOE_CHECK(x.size() == bytes, "serve: ", x.size(), " bytes for ", T, " rows");
  if (bytes > 0) be_.copy_to_device(xs_[0].get(), x.data(), bytes);
  return bytes;
}

std::vector<uint8_t> ModelStack::serve_rows_out(const kernels::Buffer& rows, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  if (bytes > 0) be_.copy_to_host(out.data(), rows.get(), bytes);
  be_.synchronize();
  return out;
}

std::vector<uint8_t> ModelStack::serve_forward(int layer, const std::vector<uint8_t>& x, int64_t T,
                                               StepReport& report) {
  const size_t bytes = serve_rows_in(x, T);
  layers_.at(layer)->forward(xs_[0].get(), T, token_begin(), out_.get());
  report.add_forward(layer, *layers_[layer], T, job_.top_k);
  return serve_rows_out(out_, bytes);
}

void ModelStack::serve_routing(int layer, int64_t T, std::vector<int32_t>& ids, std::vector<float>& weights) {
  const ep::EpLayer& l = *layers_.at(layer);
  const size_t n = static_cast<size_t>(T) * job_.top_k;
  ids.resize(n);
  weights.resize(n);
  if (n > 0) {
    be_.copy_to_host(ids.data(), l.topk_idx(), n * sizeof(int32_t));
    be_.copy_to_host(weights.data(), l.topk_weight(), n * sizeof(float));
  }
  be_.synchronize();
}

std::vector<uint8_t> ModelStack::serve_backward(int layer, const std::vector<uint8_t>& x,
                                                const std::vector<uint8_t>& grad_y, int64_t T, StepReport& report) {
  MOE_CHECK(job_.train, "serve: backward calls need a serving job with serve_train");
  const size_t bytes = serve_rows_in(x, T);
  MOE_CHECK(grad_y.size() == bytes, "serve: ", grad_y.size(), " gradient bytes for ", T, " rows");
  if (bytes > 0) be_.copy_to_device(grad_.get(), grad_y.data(), bytes);
  ep::EpLayer& l = *layers_.at(layer);
  l.forward(xs_[0].get(), T, token_begin(), out_.get());
  report.add_forward(layer, l, T, job_.top_k);
  l.backward(grad_.get(), grad_x_.get());
  report.add_backward(layer, l);
  report.set_backward_seconds(l.stats().backward);
  l.accumulate_grads();
  return serve_rows_out(grad_x_, bytes);
}

bool ModelStack::serve_optimizer_step() {
  if (serve_grads_pending() == 0) return false;
  served_steps_.resize(layers_.size(), 0);
  for (size_t l = 0; l < layers_.size(); ++l)
    if (layers_[l]->load_accumulated_grads()) layers_[l]->optimizer_step(opt_, ++served_steps_[l]);
  return true;
}

std::vector<int64_t> ModelStack::served_steps() const {
  std::vector<int64_t> out = served_steps_;
  out.resize(layers_.size(), 0);
  return out;
}

int64_t ModelStack::serve_grads_pending() const {
  int64_t passes = 0;
  for (const auto& l : layers_) passes += l->accumulated_passes();
  return passes;
}

void ModelStack::backward(StepReport& report, bool capture) {
  const size_t n = T_ * H_;
  source_->targets(xs_[0], targets_, report);
  const std::vector<float> y = model::from_storage(host_bytes(xs_.back()).data(), n, dt_);
  const std::vector<float> yt = model::from_storage(host_bytes(targets_).data(), n, dt_);
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
  const size_t n = static_cast<size_t>(job_.shape.num_experts) * H_;
  for (int l = 0; l < num_layers(); ++l) {
    const std::vector<float> g = kernels::to_host<float>(be_, layers_[l]->grad_gate(), n);
    if (!std::all_of(g.begin(), g.end(), [](float v) { return std::isfinite(v); })) return l;
  }
  return -1;
}

void ModelStack::update_selection_bias() {
  if (job_.bias_update_rate <= 0) return;
  bias_before_.clear();
  for (auto& layer : layers_) {
    bias_before_.push_back(layer->selection_bias());
    layer->update_selection_bias(job_.bias_update_rate);
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
