#include "moe/layer_spec/job_layers.h"

#include "moe/base/check.h"
#include "moe/base/text.h"
#include "moe/io/layer_io.h"

namespace moe::layer_spec {

// The spec's enums in the kernels' terms. Each is an exhaustive switch: a value
// added to the proto fails to compile (-Werror=switch) until it is mapped here.
// UNSPECIFIED takes the field's documented default.
#define MOE_PROTO_ENUM_SENTINELS(E)        \
  case v1::E##_##E##_INT_MIN_SENTINEL_DO_NOT_USE_: \
  case v1::E##_##E##_INT_MAX_SENTINEL_DO_NOT_USE_

namespace {

kernels::ScoreFunc score_func(v1::JobSpec::Score s) {
  switch (s) {
    case v1::JobSpec::SCORE_UNSPECIFIED:
    case v1::JobSpec::softmax: return kernels::ScoreFunc::kSoftmax;
    case v1::JobSpec::sigmoid: return kernels::ScoreFunc::kSigmoid;
    MOE_PROTO_ENUM_SENTINELS(JobSpec_Score): break;
  }
  detail::fail("score: unknown value ", static_cast<int>(s));
}

kernels::DropPolicy drop_policy(v1::JobSpec::DropPolicy p) {
  switch (p) {
    case v1::JobSpec::DROP_POLICY_UNSPECIFIED:
    case v1::JobSpec::probs: return kernels::DropPolicy::kProbs;
    case v1::JobSpec::position: return kernels::DropPolicy::kPosition;
    MOE_PROTO_ENUM_SENTINELS(JobSpec_DropPolicy): break;
  }
  detail::fail("drop_policy: unknown value ", static_cast<int>(p));
}

kernels::OptimizerKind optimizer_kind(v1::JobSpec::Optimizer o) {
  switch (o) {
    case v1::JobSpec::OPTIMIZER_UNSPECIFIED:
    case v1::JobSpec::adam: return kernels::OptimizerKind::kAdam;
    case v1::JobSpec::sgd: return kernels::OptimizerKind::kSgd;
    MOE_PROTO_ENUM_SENTINELS(JobSpec_Optimizer): break;
  }
  detail::fail("optimizer: unknown value ", static_cast<int>(o));
}

}  // namespace

bool is_train(const v1::JobSpec& s) {
  switch (s.mode()) {
    case v1::JobSpec::MODE_UNSPECIFIED:
    case v1::JobSpec::forward: return false;
    case v1::JobSpec::train: return true;
    case v1::JobSpec::serve: return s.serve_train();  // backward calls and steps (docs/serving.md#training)
    MOE_PROTO_ENUM_SENTINELS(JobSpec_Mode): break;
  }
  detail::fail("mode: unknown value ", static_cast<int>(s.mode()));
}

// A dtype field (dtype, moments_dtype); unset is fp32.
kernels::DType dtype_of(v1::JobSpec::DType d, const char* field) {
  switch (d) {
    case v1::JobSpec::DTYPE_UNSPECIFIED:
    case v1::JobSpec::fp32: return kernels::DType::kF32;
    case v1::JobSpec::bf16: return kernels::DType::kBF16;
    MOE_PROTO_ENUM_SENTINELS(JobSpec_DType): break;
  }
  detail::fail(field, ": unknown value ", static_cast<int>(d));
}

kernels::DType job_dtype(const v1::JobSpec& s) { return dtype_of(s.dtype(), "dtype"); }

// Joined by name, so a format needs no line here; wire_format_test checks that
// every proto value has its row.
kernels::WireChoice wire(v1::Wire w) {
  if (w == v1::WIRE_UNSPECIFIED) return std::nullopt;
  const std::optional<kernels::WireFormat> f = kernels::wire_by_name(std::string(v1::Wire_Name(w)));
  MOE_CHECK(f, "wire: unknown value ", static_cast<int>(w));
  return f;
}

ep::LayerSpec layer_spec(const v1::JobSpec& s) {
  return {.experts = s.experts(),
          .top_k = s.top_k(),
          .hidden = s.hidden(),
          .ffn_hidden = s.ffn_hidden(),
          .score = score_func(s.score()),
          .num_groups = s.num_groups(),
          .group_top_k = s.group_top_k(),
          .norm_topk_prob = s.norm_topk_prob(),
          .routed_scaling_factor = s.routed_scaling_factor(),
          .dtype = job_dtype(s),
          .capacity_factor = s.capacity_factor(),
          .drop_policy = drop_policy(s.drop_policy()),
          .tokens_per_rank = s.tokens_per_rank(),
          .train = is_train(s),
          .moments = dtype_of(s.moments_dtype(), "moments_dtype"),
          .aux_loss_coeff = s.aux_loss_coeff(),
          .z_loss_coeff = s.z_loss_coeff(),
          .bias_update_rate = s.bias_update_rate(),
          .shared_experts = s.shared_experts(),
          .shared_ffn_hidden = s.shared_ffn_hidden(),
          .shared_expert_gate = s.shared_expert_gate()};
}

JobView::JobView(const v1::JobSpec& s)
    : spec(s),
      train(is_train(s)),
      serve(s.mode() == v1::JobSpec::serve),
      serve_max_wait_ms(s.serve_max_wait_ms()),
      adam(train && optimizer_kind(s.optimizer()) == kernels::OptimizerKind::kAdam),
      dtype(job_dtype(s)),
      shape(layer_shape(s)),
      layers(s.layers()),
      top_k(s.top_k()),
      steps(s.steps()),
      tokens_per_rank(s.tokens_per_rank()),
      dispatch_wire(wire(s.dispatch_wire())),
      combine_wire(wire(s.combine_wire())),
      overlap_chunks(s.overlap_chunks()),
      exact_replica_grads(s.exact_replica_grads()),
      bias_update_rate(s.bias_update_rate()),
      elastic(s.elastic()),
      verify(s.verify()),
      verify_step(s.verify_step()),
      dump_dir(s.dump_dir()),
      dump_step(s.dump_step()),
      checkpoint_dir(s.checkpoint_dir()),
      checkpoint_every(s.checkpoint_every()),
      resume(s.resume()),
      inputs(s.inputs()),
      trace{s.trace_dir(), s.trace_tokens(), s.trace_hidden()} {}

ep::MoeLayerConfig layer_config(const v1::JobSpec& s) { return ep::layer_config(layer_spec(s)); }

v1::JobSpec teacher_of(const v1::JobSpec& s) {
  v1::JobSpec t = s;
  t.set_seed(s.seed() + 1);
  t.clear_weights();
  t.clear_weights_prefix();
  // The teacher is a fixed target: no balancing terms, its bias never moves.
  t.clear_aux_loss_coeff();
  t.clear_z_loss_coeff();
  t.clear_bias_update_rate();
  return t;
}

kernels::OptimizerConfig optimizer_config(const v1::JobSpec& s) {
  kernels::OptimizerConfig o;
  o.kind = optimizer_kind(s.optimizer());
  o.lr = static_cast<float>(s.lr());
  o.moments = dtype_of(s.moments_dtype(), "moments_dtype");
  return o;
}

model::LayerShape layer_shape(const v1::JobSpec& s) { return ep::layer_shape(layer_spec(s)); }

namespace {

// The tensor prefix of job layer `layer`: every "{layer}" in weights_prefix
// becomes the checkpoint layer weights_first_layer + layer.
std::string checkpoint_prefix(const v1::JobSpec& s, int layer) {
  return replace_all(s.weights_prefix(), "{layer}", std::to_string(s.weights_first_layer() + layer));
}

// Job layer `layer` from spec.weights; errors name the job and checkpoint layer.
model::LayerWeights checkpoint_weights(const v1::JobSpec& s, int layer, const std::vector<bool>& needed) {
  try {
    io::HfCheckpoint ckpt(s.weights());
    return io::load_layer_weights(ckpt, checkpoint_prefix(s, layer), layer_shape(s), needed);
  } catch (const Error& e) {
    detail::fail("weights of layer ", layer, " (checkpoint layer ", s.weights_first_layer() + layer, "): ", e.what());
  }
}

}  // namespace

model::LayerWeights layer_weights(const v1::JobSpec& s, int layer, const std::vector<bool>& needed,
                                  kernels::ThreadPool* pool) {
  model::ForEach on_pool;
  if (pool)
    on_pool = [pool](int64_t n, const std::function<void(int64_t)>& body) {
      pool->parallel_for(n, [&](int64_t i, int) { body(i); });
    };
  model::LayerWeights w = s.weights().empty()
                              ? model::make_layer_weights(s.seed(), layer, layer_shape(s), needed, on_pool)
                              : checkpoint_weights(s, layer, needed);
  w.logit_bias = model::skew_logit_bias(s.skew(), s.seed(), s.experts());
  return w;
}

std::vector<float> step_inputs(const v1::JobSpec& s, int rank, int step, kernels::ThreadPool& pool) {
  const int64_t T = s.tokens_per_rank(), H = s.hidden(), block = 64;
  std::vector<float> x(T * H);
  // Tokens are independent (keyed by their global index): blocks on the rank's threads.
  pool.parallel_for((T + block - 1) / block, [&](int64_t b, int) {
    const int64_t t0 = b * block, n = std::min(block, T - t0);
    model::fill_inputs(s.seed(), step, static_cast<int64_t>(rank) * T + t0, n, static_cast<int>(H), x.data() + t0 * H);
  });
  if (job_dtype(s) == kernels::DType::kBF16) model::round_to_bf16(x);
  return x;
}

}  // namespace moe::layer_spec
