// Making and packing the CPU backend's PackedWeights (router and experts).
#include "packed_weights.h"


#include "moe/base/check.h"
#include "small_gemm.h"
#include "vec.h"

namespace moe::kernels::cpu {
namespace {

std::unique_ptr<OneDnnMatmul> matmul(const MatmulShape& s) { return std::make_unique<OneDnnMatmul>(s); }

// A primitive whose B is a packed weight stored [n, k] (C = A W^T) or [k, n].
MatmulShape weight_gemm(DType d, int64_t k, int64_t n, bool w_nk) {
  MatmulShape s;
  s.dtype = d;
  s.k = k;
  s.n = n;
  s.lda = k;
  s.ldc = n;
  s.packed_b = true;
  s.b_nk = w_nk;
  return s;
}

// Weight gradient rows: C [m, n] = A^T B (accumulate: C += A^T B) with A stored
// [k, m] (row stride lda), B [k, n]; m and k given per call.
MatmulShape wgrad_gemm(DType d, int64_t lda, int64_t n, bool accumulate = false) {
  MatmulShape s;
  s.accumulate = accumulate;
  s.dtype = d;
  s.k = kRuntimeDim;
  s.n = n;
  s.lda = lda;
  s.ldb = n;
  s.ldc = n;
  s.trans_a = true;
  return s;
}

}  // namespace

PackedTensor::PackedTensor(const OneDnnMatmul& mm, int num_experts)
    : stride(align64(mm.packed_b_bytes())), data(stride * num_experts) {}

std::unique_ptr<PackedWeights> make_router_weights(const RouterConfig& cfg, GemmEngine engine) {
  cfg.validate();
  auto p = std::make_unique<CpuRouterWeights>();
  p->cfg = cfg;
  p->engine = engine;
  if (engine == GemmEngine::kOneDnn) {
    p->logits = matmul(weight_gemm(cfg.x_dtype, cfg.hidden, cfg.num_experts, true));
    p->gate = PackedTensor(*p->logits, 1);
  }
  return p;
}

void pack_router_weights(ThreadPool&, PackedWeights& packed, const float* weight) {
  auto* p = dynamic_cast<CpuRouterWeights*>(&packed);
  MOE_CHECK(p, "pack_router_weights: the packed weights are not the CPU backend's router weights");
  if (p->logits) p->logits->pack_b(weight, p->gate.expert(0));
  p->packed = true;
}

PanelTensor::PanelTensor(const RowGemmPanels& shape, int num_experts)
    : panels(shape),
      stride(align64(row_gemm_panel_elems(shape.kernel, shape.k, shape.n) * dtype_size(shape.dtype))),
      data(stride * num_experts) {}

RowGemmPanels PanelTensor::expert(int e) const {
  RowGemmPanels p = panels;
  p.data = data.get() + stride * e;
  return p;
}

std::unique_ptr<PackedWeights> make_expert_weights(const ExpertMlpConfig& c, GemmEngine engine) {
  c.validate();
  auto p = std::make_unique<CpuExpertWeights>();
  p->cfg = c;
  p->engine = engine;
  const DType d = c.x_dtype;
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const int L = c.num_experts;
  const RowGemmKernel kernel = row_gemm_kernel();
  p->w13_fwd = PanelTensor({nullptr, d, kernel, H, 2 * I}, L);  // B = w13_e^T [H, 2I]
  p->w2_fwd = PanelTensor({nullptr, d, kernel, I, H}, L);       // B = w2_e^T [I, H]
  if (d == DType::kBF16 && !c.train && L > 0) {
    p->small_w13_elems = small_bf16_weight_elems(2 * I, H);
    p->small_w2_elems = small_bf16_weight_elems(H, I);
    p->small_w13 = HostBytes(align64(p->small_w13_elems * L * sizeof(bf16_t)));
    p->small_w2 = HostBytes(align64(p->small_w2_elems * L * sizeof(bf16_t)));
  }
  if (engine == GemmEngine::kOneDnn && c.train) {
    p->down_wgrad = matmul(wgrad_gemm(d, H, I));             // g^T [H, rows] h [rows, I]
    p->gate_up_wgrad = matmul(wgrad_gemm(d, 2 * I, H));      // dgu^T [2I, rows] x [rows, H]
    p->down_wgrad_acc = matmul(wgrad_gemm(d, H, I, true));
    p->gate_up_wgrad_acc = matmul(wgrad_gemm(d, 2 * I, H, true));
  }
  return p;
}

namespace {

// The forward panels of expert e's rows [r0, r1) of one weight (w13_e [2I, H] or
// w2_e [H, I], rows of w = columns of B); r0 a multiple of 32 (a panel of every kernel).
void pack_forward_rows(PanelTensor& t, const float* w, int64_t e, int64_t r0, int64_t r1) {
  const RowGemmPanels& s = t.panels;
  pack_row_gemm_panels(s.kernel, w + e * s.k * s.n, true, s.k, s.n, s.dtype, t.expert_data(static_cast<int>(e)), r0,
                       r1);
}

}  // namespace

void pack_expert_weights(ThreadPool& pool, PackedWeights& packed, const float* w13, const float* w2, int first,
                         int count) {
  auto* p = dynamic_cast<CpuExpertWeights*>(&packed);
  MOE_CHECK(p, "pack_expert_weights: the packed weights are not the CPU backend's expert weights");
  MOE_CHECK(first >= 0 && count >= 0 && first + count <= p->cfg.num_experts, "pack_expert_weights: experts [", first,
            ", ", first + count, ") are not within the ", p->cfg.num_experts, " the weights were made for");
  const int64_t H = p->cfg.hidden, I = p->cfg.ffn_hidden;
  pool.parallel_for(2 * static_cast<int64_t>(count), [&](int64_t task, int) {
    const int64_t e = first + task / 2;
    if (task % 2 == 0)
      pack_forward_rows(p->w13_fwd, w13, e, 0, 2 * I);
    else
      pack_forward_rows(p->w2_fwd, w2, e, 0, H);
  });
  if (p->small_w13.get() && count > 0) {
    auto* s13 = reinterpret_cast<bf16_t*>(p->small_w13.get());
    auto* s2 = reinterpret_cast<bf16_t*>(p->small_w2.get());
    pool.parallel_for(count, [&](int64_t i, int) {
      const int64_t e = first + i;
      pack_small_bf16_weights(w13 + e * 2 * I * H, 2 * I, H, s13 + e * p->small_w13_elems);
      pack_small_bf16_weights(w2 + e * H * I, H, I, s2 + e * p->small_w2_elems);
    });
  }
  p->packed = true;
}

// Tasks of one block of rows of one expert's weight: the optimizer steps the
// block's elements, then the block's rows are packed into their panels from L2,
// where the step left them (a whole expert's weight, 8-16 MB with its gradient
// and moments, would not stay: stepping and packing whole experts measured no
// faster than two passes). 32 rows: whole panels of every kernel; at H=1024 the
// four fp32 streams of a block take 512 KB, half a Zen 4 core's L2 (64 rows
// measured slower for bf16, alike for fp32). The bits are those of the two passes.
void update_expert_weights(ThreadPool& pool, const OptimizerConfig& cfg, const OptimizerArgs& w13,
                           const OptimizerArgs& w2, PackedWeights& packed, int num_experts) {
  auto* p = dynamic_cast<CpuExpertWeights*>(&packed);
  MOE_CHECK(p, "update_expert_weights: the packed weights are not the CPU backend's expert weights");
  MOE_CHECK(num_experts == p->cfg.num_experts, "update_expert_weights: ", num_experts,
            " experts, the packed weights were made for ", p->cfg.num_experts);
  if (p->small_w13.get() || num_experts == 0) {
    optimizer_step(pool, cfg, w13);
    optimizer_step(pool, cfg, w2);
    pack_expert_weights(pool, packed, w13.weight, w2.weight, 0, num_experts);
    return;
  }
  const int64_t H = p->cfg.hidden, I = p->cfg.ffn_hidden, L = num_experts;
  MOE_CHECK(w13.count == L * 2 * I * H && w2.count == L * H * I, "update_expert_weights: ", w13.count, " and ",
            w2.count, " values for ", L, " experts of H=", H, ", I=", I);
  struct Weight {
    const OptimizerArgs* args;
    OptimizerPass pass;
    int64_t rows, cols;  // as stored: w13_e [2I, H], w2_e [H, I]
    PanelTensor* forward;
  };
  const Weight weights[2] = {{&w13, prepare_optimizer(cfg, w13), 2 * I, H, &p->w13_fwd},
                             {&w2, prepare_optimizer(cfg, w2), H, I, &p->w2_fwd}};
  constexpr int64_t block = 32;
  const int64_t blocks13 = (2 * I + block - 1) / block, blocks2 = (H + block - 1) / block;
  pool.parallel_for(L * (blocks13 + blocks2), [&](int64_t task, int) {
    const int64_t e = task / (blocks13 + blocks2), b = task % (blocks13 + blocks2);
    const Weight& w = weights[b < blocks13 ? 0 : 1];
    const int64_t r0 = (b < blocks13 ? b : b - blocks13) * block, r1 = std::min(w.rows, r0 + block);
    const int64_t at = e * w.rows * w.cols;
    optimizer_range(w.pass, *w.args, at + r0 * w.cols, at + r1 * w.cols);
    pack_forward_rows(*w.forward, w.args->weight, e, r0, r1);
  });
  p->packed = true;
}

const void* CpuExpertWeights::small_expert_w13(int e, const float* w13) const {
  if (cfg.x_dtype == DType::kF32) return w13 + static_cast<int64_t>(e) * 2 * cfg.ffn_hidden * cfg.hidden;
  return reinterpret_cast<const bf16_t*>(small_w13.get()) + e * small_w13_elems;
}

const void* CpuExpertWeights::small_expert_w2(int e, const float* w2) const {
  if (cfg.x_dtype == DType::kF32) return w2 + static_cast<int64_t>(e) * cfg.hidden * cfg.ffn_hidden;
  return reinterpret_cast<const bf16_t*>(small_w2.get()) + e * small_w2_elems;
}

const CpuRouterWeights& checked_router_weights(const PackedWeights* packed, const RouterConfig& cfg) {
  MOE_CHECK(packed, "router: packed_weight is null (make_router_weights, then pack_router_weights)");
  const auto* p = dynamic_cast<const CpuRouterWeights*>(packed);
  MOE_CHECK(p, "router: packed_weight is not the CPU backend's router weights");
  MOE_CHECK(p->cfg.hidden == cfg.hidden, "router: packed_weight was made for hidden ", p->cfg.hidden, ", not ",
            cfg.hidden);
  MOE_CHECK(p->cfg.num_experts == cfg.num_experts, "router: packed_weight was made for num_experts ",
            p->cfg.num_experts, ", not ", cfg.num_experts);
  MOE_CHECK(p->cfg.x_dtype == cfg.x_dtype, "router: packed_weight was made for x_dtype ", dtype_name(p->cfg.x_dtype),
            ", not ", dtype_name(cfg.x_dtype));
  MOE_CHECK(p->packed, "router: packed_weight holds no values (pack_router_weights was not called)");
  return *p;
}

const CpuExpertWeights& checked_expert_weights(const PackedWeights* packed, const ExpertMlpConfig& cfg,
                                               bool backward) {
  MOE_CHECK(packed, "expert mlp: packed is null (make_expert_weights, then pack_expert_weights)");
  const auto* p = dynamic_cast<const CpuExpertWeights*>(packed);
  MOE_CHECK(p, "expert mlp: packed is not the CPU backend's expert weights");
  const ExpertMlpConfig& m = p->cfg;
  MOE_CHECK(m.num_experts == cfg.num_experts, "expert mlp: packed weights were made for num_experts ",
            m.num_experts, ", not ", cfg.num_experts);
  MOE_CHECK(m.hidden == cfg.hidden, "expert mlp: packed weights were made for hidden ", m.hidden, ", not ",
            cfg.hidden);
  MOE_CHECK(m.ffn_hidden == cfg.ffn_hidden, "expert mlp: packed weights were made for ffn_hidden ", m.ffn_hidden,
            ", not ", cfg.ffn_hidden);
  MOE_CHECK(m.x_dtype == cfg.x_dtype, "expert mlp: packed weights were made for x_dtype ", dtype_name(m.x_dtype),
            ", not ", dtype_name(cfg.x_dtype));
  MOE_CHECK(!backward || m.train, "expert mlp backward: packed weights were made with train = false");
  MOE_CHECK(p->packed, "expert mlp: packed weights hold no values (pack_expert_weights was not called)");
  return *p;
}

}  // namespace moe::kernels::cpu
