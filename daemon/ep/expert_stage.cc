#include "moe/ep/expert_stage.h"

#include <algorithm>

#include "moe/base/check.h"
#include "moe/base/clock.h"

namespace moe::ep {

using kernels::Buffer;

ExpertStage::ExpertStage(const MoeLayerConfig& cfg, int num_local_experts, kernels::Backend& be)
    : cfg_(cfg), L_(num_local_experts), be_(be) {
  MOE_CHECK(L_ >= 0, "expert stage: negative expert count ", L_);
  const size_t H = cfg.hidden, I = cfg.ffn_hidden, L = L_;
  host_.expert_offset.assign(L + 1, 0);
  w13_ = Buffer(be, 4 * L * 2 * I * H);
  w2_ = Buffer(be, 4 * L * H * I);
  if (cfg.train) {
    grad_w13_ = Buffer(be, 4 * L * 2 * I * H);
    grad_w2_ = Buffer(be, 4 * L * H * I);
    // w13_ and w2_ are the masters in either dtype: the packed weights are what
    // the kernels compute with, and they round a bf16 layer's (api.h).
    w13_param_.bind(be, w13_.as<float>(), L * 2 * I * H, ComputeCopy::kIsMaster, cfg.moments);
    w2_param_.bind(be, w2_.as<float>(), L * H * I, ComputeCopy::kIsMaster, cfg.moments);
  }
  kernels::ExpertMlpConfig shape = mlp_config();  // only the weights' shape matters here
  shape.max_rows = shape.max_src_rows = 0;
  packed_ = be.make_expert_weights(shape);
}

void ExpertStage::pack_weights(int first, int count) {
  be_.pack_expert_weights(*packed_, w13_.as<float>(), w2_.as<float>(), first, count);
}

void ExpertStage::set_weights(const float* w13, const float* w2) {
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, L = L_;
  be_.copy_to_device(w13_.get(), w13, 4 * L * 2 * I * H);
  be_.copy_to_device(w2_.get(), w2, 4 * L * H * I);
  w13_param_.sync_master();
  w2_param_.sync_master();
  pack_weights(0, L_);
}

void ExpertStage::apply_update(const kernels::OptimizerConfig& cfg, int64_t step) {
  MOE_CHECK(cfg_.train, "apply_update on a layer built without train = true");
  be_.update_expert_weights(cfg, w13_param_.optimizer_args(cfg, step, grad_w13_.as<float>()),
                            w2_param_.optimizer_args(cfg, step, grad_w2_.as<float>()), *packed_, L_);
}

void ExpertState::resize(int hidden, int ffn_hidden, bool moments) {
  const size_t n = 3 * static_cast<size_t>(hidden) * ffn_hidden;
  weights.assign(n, 0.0f);
  m.assign(moments ? n : 0, 0.0f);
  v.assign(moments ? n : 0, 0.0f);
}

std::vector<float> ExpertState::to_wire() const {
  std::vector<float> w;
  w.reserve(floats());
  for (const auto* part : {&weights, &m, &v}) w.insert(w.end(), part->begin(), part->end());
  return w;
}

void ExpertState::from_wire(const std::vector<float>& wire) {
  MOE_CHECK(wire.size() == floats(), "expert state: ", wire.size(), " values on the wire, expected ", floats());
  auto at = wire.begin();
  for (auto* part : {&weights, &m, &v}) {
    std::copy(at, at + static_cast<std::ptrdiff_t>(part->size()), part->begin());
    at += static_cast<std::ptrdiff_t>(part->size());
  }
}

void ExpertStage::copy_slot(const ExpertStage& src, int from, int to) {
  if (!cfg_.train) return copy_compute_weights(src, from, to);
  MOE_CHECK(from >= 0 && from < src.L_ && to >= 0 && to < L_, "expert stage: copy of slot ", from, " to slot ", to);
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, n13 = 2 * I * H, n2 = H * I;
  w13_param_.copy_range(src.w13_param_, from * n13, to * n13, n13);
  w2_param_.copy_range(src.w2_param_, from * n2, to * n2, n2);
  pack_weights(to, 1);
}

// w13_ and w2_ are what a stage computes with (a train stage's masters, which the
// packing rounds for a bf16 layer).
void ExpertStage::copy_compute_weights(const ExpertStage& src, int from, int to) {
  MOE_CHECK(from >= 0 && from < src.L_ && to >= 0 && to < L_, "expert stage: copy of slot ", from, " to slot ", to);
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, n13 = 2 * I * H, n2 = H * I;
  be_.copy(w13_.as<float>() + to * n13, src.w13_.as<float>() + from * n13, 4 * n13);
  be_.copy(w2_.as<float>() + to * n2, src.w2_.as<float>() + from * n2, 4 * n2);
  pack_weights(to, 1);
}

void ExpertStage::touch(bool moments) {
  for (kernels::Buffer* b : {&w13_, &w2_, &grad_w13_, &grad_w2_, &pairs_.pair_y, &pairs_.saved_gu, &pairs_.mlp_ws})
    if (b->get()) be_.fill_zero(b->get(), b->bytes());
  if (moments && cfg_.train) {
    w13_param_.ensure_moments();
    w2_param_.ensure_moments();
  }
}

void ExpertStage::copy_weights(int s, float* w13, float* w2) const {
  MOE_CHECK(s >= 0 && s < L_, "expert stage: no local slot ", s);
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, n13 = 2 * I * H, n2 = H * I;
  be_.copy_to_host(w13, w13_.as<float>() + s * n13, 4 * n13);
  be_.copy_to_host(w2, w2_.as<float>() + s * n2, 4 * n2);
  if (cfg_.dtype == DType::kBF16) {  // a train stage's masters, as the kernels use them
    std::transform(w13, w13 + n13, w13, kernels::round_to_bf16);
    std::transform(w2, w2 + n2, w2, kernels::round_to_bf16);
  }
}

void ExpertStage::export_slot(int s, ExpertState& out) const {
  MOE_CHECK(s >= 0 && s < L_, "expert stage: no local slot ", s);
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, n13 = 2 * I * H, n2 = H * I;
  float* m = out.m.empty() ? nullptr : out.m.data();
  float* v = out.v.empty() ? nullptr : out.v.data();
  if (!cfg_.train) {  // the weights it computes with
    be_.copy_to_host(out.weights.data(), w13_.as<float>() + s * n13, 4 * n13);
    be_.copy_to_host(out.weights.data() + n13, w2_.as<float>() + s * n2, 4 * n2);
    return;
  }
  w13_param_.read(s * n13, n13, out.weights.data(), m, v);
  w2_param_.read(s * n2, n2, out.weights.data() + n13, m ? m + n13 : nullptr, v ? v + n13 : nullptr);
}

void ExpertStage::import_slot(int s, const ExpertState& in) {
  MOE_CHECK(s >= 0 && s < L_, "expert stage: no local slot ", s);
  const size_t H = cfg_.hidden, I = cfg_.ffn_hidden, n13 = 2 * I * H, n2 = H * I;
  MOE_CHECK(in.weights.size() == n13 + n2, "expert stage: an expert state of ", in.weights.size(), " values, expected ",
            n13 + n2);
  if (!cfg_.train) {
    be_.copy_to_device(w13_.as<float>() + s * n13, in.weights.data(), 4 * n13);
    be_.copy_to_device(w2_.as<float>() + s * n2, in.weights.data() + n13, 4 * n2);
  } else {
    const float* m = in.m.empty() ? nullptr : in.m.data();
    const float* v = in.v.empty() ? nullptr : in.v.data();
    w13_param_.write(s * n13, n13, in.weights.data(), m, v);
    w2_param_.write(s * n2, n2, in.weights.data() + n13, m ? m + n13 : nullptr, v ? v + n13 : nullptr);
  }
  pack_weights(s, 1);
}

kernels::ExpertMlpConfig ExpertStage::mlp_config() const {
  kernels::ExpertMlpConfig m;
  m.num_experts = L_;
  m.hidden = cfg_.hidden;
  m.ffn_hidden = cfg_.ffn_hidden;
  m.max_rows = capacity_rows_ * std::min(cfg_.top_k, std::max(L_, 1));
  m.max_src_rows = capacity_rows_;
  m.x_dtype = cfg_.dtype;
  m.train = cfg_.train;
  return m;
}

void ExpertStage::reserve(int64_t rows) {
  if (rows <= capacity_rows_) return;
  capacity_rows_ = rows;
  const size_t N = rows, K = cfg_.top_k, H = cfg_.hidden, I = cfg_.ffn_hidden;
  const size_t M = N * std::min<size_t>(K, std::max(L_, 1));  // a row has at most min(K, L) local pairs
  pairs_.perm_src_row = Buffer(be_, 4 * N * K);
  pairs_.perm_weight = Buffer(be_, 4 * N * K);
  pairs_.pair_pos = Buffer(be_, 4 * N * K);
  pairs_.pair_y = Buffer(be_, 4 * M * H);
  pairs_.pair_src = Buffer(be_, 4 * M);
  if (cfg_.train) {
    pairs_.wgrad_order = Buffer(be_, 4 * M);
    pairs_.saved_gu = Buffer(be_, 4 * M * 2 * I);
    pairs_.grad_perm_weight = Buffer(be_, 4 * M);
  }
  pairs_.layout_ws = Buffer(be_, be_.permute_layout_workspace_bytes({rows, cfg_.top_k, L_}));
  pairs_.mlp_ws = Buffer(be_, be_.expert_mlp_workspace_bytes(mlp_config()));
}

void ExpertStage::forward(const void* rows, int64_t N, const int32_t* row_expert, const float* row_weight,
                          void* combined, const RowLayout& rl) {
  layout(row_expert, row_weight, N, rl);
  run_forward(rows, 0, N, combined, {});
}

void ExpertStage::backward(const void* grad_combined, void* grad_rows, DType grad_rows_dtype,
                           float* grad_pair_weight) {
  // One call for the dgrad chain and the weight gradients.
  run_dgrad(grad_combined, 0, N_, grad_rows, grad_rows_dtype, grad_pair_weight, {}, kernels::MlpBackwardPhase::kAll);
  has_forward_ = false;  // the backward consumed the forward's saved_gu (api.h)
}

void ExpertStage::layout(const int32_t* row_expert, const float* row_weight, int64_t N, const RowLayout& rl) {
  reserve(N);
  N_ = N;
  rows_ = grad_combined_ = nullptr;
  has_layout_ = true;
  host_.valid = false;
  has_forward_ = false;
  parts_.clear();
  dgrad_rows_ = 0;
  times_ = {};
  const double t0 = now_seconds();
  kernels::PermuteLayoutArgs pl;
  pl.row_expert = row_expert;
  pl.row_weight = row_weight;
  pl.expert_offset = host_.expert_offset.data();
  pl.perm_src_row = pairs_.perm_src_row.as<int32_t>();
  pl.perm_weight = pairs_.perm_weight.as<float>();
  pl.pair_pos = pairs_.pair_pos.as<int32_t>();
  pl.workspace = pairs_.layout_ws.get();
  pl.row_order = rl.row_order;
  be_.permute_layout({N, cfg_.top_k, L_}, pl);
  MOE_CHECK(host_.expert_offset[L_] <= mlp_config().max_rows, "expert stage: ", host_.expert_offset[L_],
            " pairs exceed the reserved ", mlp_config().max_rows);
  be_.synchronize();
  lay_out_pair_rows(rl.pair_row_offset);
  order_weight_grads(rl.row_order ? rl.source_key : nullptr);
  times_.layout = now_seconds() - t0;
}

void ExpertStage::copy_layout_to_host() {
  if (host_.valid) return;
  const int64_t M = host_.expert_offset[L_];
  host_.src_row.resize(M);
  host_.pair_pos.resize(N_ * cfg_.top_k);
  be_.copy_to_host(host_.src_row.data(), pairs_.perm_src_row.get(), 4 * M);
  be_.copy_to_host(host_.pair_pos.data(), pairs_.pair_pos.get(), 4 * N_ * cfg_.top_k);
  host_.valid = true;
}

// The output row of every pair, when the caller asked for pair rows: row n's
// pairs (pair_pos >= 0) in k order from pair_row_offset[n], which must count them.
void ExpertStage::lay_out_pair_rows(const int64_t* pair_row_offset) {
  host_.pair_row_offset.clear();
  if (!pair_row_offset) return;
  const int K = cfg_.top_k;
  copy_layout_to_host();
  host_.pair_row_offset.assign(pair_row_offset, pair_row_offset + N_ + 1);
  host_.pair_src.clear();
  for (int64_t n = 0; n < N_; ++n) {
    for (int k = 0; k < K; ++k)
      if (host_.pair_pos[n * K + k] >= 0) host_.pair_src.push_back(host_.pair_pos[n * K + k]);
    MOE_CHECK(static_cast<int64_t>(host_.pair_src.size()) == host_.pair_row_offset[n + 1],
              "expert stage: row ", n, " has ", host_.pair_src.size() - host_.pair_row_offset[n],
              " local pairs, its pair rows say ", host_.pair_row_offset[n + 1] - host_.pair_row_offset[n]);
  }
  be_.copy_to_device(pairs_.pair_src.get(), host_.pair_src.data(), 4 * host_.pair_src.size());
}

// The weight gradients' order: each expert's pairs by their rows' source keys
// (stable), when the layout's order (row_order's) may differ from it.
void ExpertStage::order_weight_grads(const int64_t* source_key) {
  host_.wgrad_ordered = cfg_.train && source_key;
  if (!host_.wgrad_ordered) return;
  copy_layout_to_host();
  const int64_t M = host_.expert_offset[L_];
  host_.wgrad_order.resize(M);
  for (int64_t m = 0; m < M; ++m) host_.wgrad_order[m] = static_cast<int32_t>(m);
  for (int e = 0; e < L_; ++e)
    std::stable_sort(host_.wgrad_order.begin() + host_.expert_offset[e], host_.wgrad_order.begin() + host_.expert_offset[e + 1],
                     [&](int32_t a, int32_t b) {
                       return source_key[host_.src_row[a]] < source_key[host_.src_row[b]];
                     });
  be_.copy_to_device(pairs_.wgrad_order.get(), host_.wgrad_order.data(), 4 * M);
}

// pairs_.pair_y's values of rows [first, first + n) into out: summed per row in k
// order, or one row per pair (pair rows).
void ExpertStage::write_rows(int64_t first, int64_t n, void* out, DType dtype) {
  const int K = cfg_.top_k, H = cfg_.hidden;
  const size_t out_row = kernels::dtype_size(dtype) * H;
  if (host_.pair_row_offset.empty()) {
    be_.unpermute({n, K, H, dtype, false, DType::kF32, host_.expert_offset[L_]},
                  {pairs_.pair_y.get(), pairs_.pair_pos.as<int32_t>() + first * K, nullptr,
                   static_cast<uint8_t*>(out) + first * out_row});
    return;
  }
  const int64_t p0 = host_.pair_row_offset[first], p1 = host_.pair_row_offset[first + n];
  be_.unpermute({p1 - p0, 1, H, dtype, false, DType::kF32, host_.expert_offset[L_]},
                {pairs_.pair_y.get(), pairs_.pair_src.as<int32_t>() + p0, nullptr, static_cast<uint8_t*>(out) + p0 * out_row});
}

// The next part: each expert's pairs from where the last part ended, as long as
// their rows are in [first, first + n); all of the rows' pairs must be found.
const ExpertStage::Part& ExpertStage::add_part(int64_t first, int64_t n) {
  const int K = cfg_.top_k;
  copy_layout_to_host();
  Part p{.first = first, .n = n, .begin = std::vector<int64_t>(L_), .end = std::vector<int64_t>(L_)};
  int64_t found = 0, want = 0;
  for (int e = 0; e < L_; ++e) {
    int64_t m = parts_.empty() ? host_.expert_offset[e] : parts_.back().end[e];
    p.begin[e] = m;
    while (m < host_.expert_offset[e + 1] && host_.src_row[m] >= first && host_.src_row[m] < first + n) ++m;
    p.end[e] = m;
    found += m - p.begin[e];
  }
  for (int64_t i = first * K; i < (first + n) * K; ++i) want += host_.pair_pos[i] >= 0;
  MOE_CHECK(found == want, "expert stage: rows [", first, ", ", first + n, ") are not the next part of the layout's ",
            "row order (", found, " of their ", want, " pairs follow the last part)");
  parts_.push_back(std::move(p));
  return parts_.back();
}

const ExpertStage::Part* ExpertStage::part_of(int64_t first, int64_t n) const {
  for (const Part& p : parts_)
    if (p.first == first && p.n == n) return &p;
  return nullptr;
}

void ExpertStage::forward_rows(const void* rows, int64_t first, int64_t n, void* combined) {
  MOE_CHECK(has_layout_, "expert stage: forward_rows before layout");
  MOE_CHECK(first >= 0 && n >= 0 && first + n <= N_, "expert stage: rows [", first, ", ", first + n,
            ") of a layout of ", N_);
  const Part& p = add_part(first, n);
  run_forward(rows, first, n, combined, {.pair_begin = p.begin.data(), .pair_end = p.end.data()});
}

// The MLP over the part's pairs, then the local combine of rows [first, first + n).
void ExpertStage::run_forward(const void* rows, int64_t first, int64_t n, void* combined,
                              const kernels::ExpertMlpPart& part) {
  rows_ = rows;
  has_forward_ = true;
  double t0 = now_seconds();
  kernels::ExpertMlpForwardArgs a;
  a.rows = rows;
  a.expert_offset = host_.expert_offset.data();
  a.perm_src_row = pairs_.perm_src_row.as<int32_t>();
  a.perm_weight = pairs_.perm_weight.as<float>();
  a.w13 = w13_.as<float>();
  a.w2 = w2_.as<float>();
  a.packed = packed_.get();
  a.y = pairs_.pair_y.as<float>();
  a.saved_gu = cfg_.train ? pairs_.saved_gu.as<float>() : nullptr;
  a.workspace = pairs_.mlp_ws.get();
  a.stats = &times_.mlp_stats;
  a.part = part;
  be_.expert_mlp_forward(mlp_config(), a);
  be_.synchronize();
  double t1 = now_seconds();
  times_.mlp += t1 - t0;

  // y is already weighted: the local combine is a plain per-row sum.
  write_rows(first, n, combined, cfg_.dtype);
  be_.synchronize();
  times_.combine += now_seconds() - t1;
}

kernels::ExpertMlpBackwardArgs ExpertStage::backward_args(const void* grad_combined,
                                                          kernels::MlpBackwardPhase phase) const {
  kernels::ExpertMlpBackwardArgs m;
  m.grad_rows = grad_combined;
  m.rows = rows_;
  m.expert_offset = host_.expert_offset.data();
  m.perm_src_row = pairs_.perm_src_row.as<int32_t>();
  m.perm_weight = pairs_.perm_weight.as<float>();
  m.w13 = w13_.as<float>();
  m.w2 = w2_.as<float>();
  m.packed = packed_.get();
  m.saved_gu = pairs_.saved_gu.as<float>();
  m.grad_perm_x = pairs_.pair_y.as<float>();
  m.grad_perm_weight = pairs_.grad_perm_weight.as<float>();
  m.grad_w13 = grad_w13_.as<float>();
  m.grad_w2 = grad_w2_.as<float>();
  m.wgrad_order = host_.wgrad_ordered ? pairs_.wgrad_order.as<int32_t>() : nullptr;
  m.workspace = pairs_.mlp_ws.get();
  m.phase = phase;
  return m;
}

void ExpertStage::backward_rows(const void* grad_combined, int64_t first, int64_t n, void* grad_rows,
                                DType grad_rows_dtype, float* grad_pair_weight) {
  const Part* p = part_of(first, n);
  MOE_CHECK(p, "expert stage: backward of rows [", first, ", ", first + n, ") that no forward part computed");
  run_dgrad(grad_combined, first, n, grad_rows, grad_rows_dtype, grad_pair_weight,
            {.pair_begin = p->begin.data(), .pair_end = p->end.data()}, kernels::MlpBackwardPhase::kDgrad);
}

// The dgrad chain over the part's pairs (with kAll, the weight gradients too),
// then the gradients of rows [first, first + n).
void ExpertStage::run_dgrad(const void* grad_combined, int64_t first, int64_t n, void* grad_rows,
                            DType grad_rows_dtype, float* grad_pair_weight, const kernels::ExpertMlpPart& part,
                            kernels::MlpBackwardPhase phase) {
  MOE_CHECK(cfg_.train, "backward on a layer built without train = true");
  MOE_CHECK(has_forward_, "backward called before forward (each backward consumes its forward's saved activations)");
  MOE_CHECK(dgrad_rows_ == 0 || grad_combined == grad_combined_,
            "expert stage: the backward's row parts read different gradient buffers");
  grad_combined_ = grad_combined;
  const int K = cfg_.top_k;
  kernels::ExpertMlpBackwardArgs m = backward_args(grad_combined, phase);
  m.part = part;
  be_.expert_mlp_backward(mlp_config(), m);
  write_rows(first, n, grad_rows, grad_rows_dtype);
  be_.unpermute_scalars(pairs_.pair_pos.as<int32_t>() + first * K, n, K, pairs_.grad_perm_weight.as<float>(),
                        grad_pair_weight + first * K);
  dgrad_rows_ += n;
}

void ExpertStage::weight_grads() {
  MOE_CHECK(has_forward_ && dgrad_rows_ == N_, "expert stage: weight gradients after the dgrad of ", dgrad_rows_,
            " of ", N_, " rows");
  be_.expert_mlp_backward(mlp_config(), backward_args(grad_combined_, kernels::MlpBackwardPhase::kWgrad));
  has_forward_ = false;  // the backward consumed the forward's saved_gu (api.h)
}

std::vector<int64_t> ExpertStage::expert_rows() const {
  std::vector<int64_t> counts(L_);
  for (int e = 0; e < L_; ++e) counts[e] = host_.expert_offset[e + 1] - host_.expert_offset[e];
  return counts;
}

}  // namespace moe::ep
