// Making and packing the CPU backend's PackedWeights (router and experts).
#include "packed_weights.h"

#include "moe/base/check.h"
#include "vec.h"

namespace moe::kernels::cpu {
namespace {

std::unique_ptr<OneDnnMatmul> matmul(const MatmulShape& s) { return std::make_unique<OneDnnMatmul>(s); }

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

PanelTensor::PanelTensor(const RowGemmPanels& shape, int num_experts)
    : panels(shape),
      stride(align64(row_gemm_panel_elems(shape.kernel, shape.k, shape.n) * dtype_size(shape.dtype))),
      data(stride * num_experts) {}

RowGemmPanels PanelTensor::expert(int e) const {
  RowGemmPanels p = panels;
  p.data = data.get() + stride * e;
  return p;
}

std::unique_ptr<PackedWeights> make_router_weights(const RouterConfig& cfg, GemmEngine engine) {
  cfg.validate();
  auto p = std::make_unique<CpuRouterWeights>();
  p->cfg = cfg;
  p->engine = engine;
  p->gate_t = PanelTensor({nullptr, DType::kF32, row_gemm_kernel(), cfg.hidden, cfg.num_experts}, 1);
  return p;
}

void pack_router_weights(ThreadPool&, PackedWeights& packed, const float* weight) {
  auto* p = dynamic_cast<CpuRouterWeights*>(&packed);
  MOE_CHECK(p, "pack_router_weights: the packed weights are not the CPU backend's router weights");
  const RowGemmPanels& s = p->gate_t.panels;
  pack_row_gemm_panels(s.kernel, weight, true, s.k, s.n, s.dtype, p->gate_t.expert_data(0), 0, s.n);
  p->packed = true;
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
  if (num_experts == 0) return;
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
