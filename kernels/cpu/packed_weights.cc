// Making and packing the CPU backend's PackedWeights (router and experts).
#include "packed_weights.h"

#include <tuple>

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

std::unique_ptr<PackedWeights> make_expert_weights(const ExpertMlpConfig& c, GemmEngine engine) {
  c.validate();
  auto p = std::make_unique<CpuExpertWeights>();
  p->cfg = c;
  p->engine = engine;
  if (c.x_dtype == DType::kBF16 && !c.train && c.num_experts > 0) {
    p->small_w13_elems = small_bf16_weight_elems(2 * static_cast<int64_t>(c.ffn_hidden), c.hidden);
    p->small_w2_elems = small_bf16_weight_elems(c.hidden, c.ffn_hidden);
    p->small_w13 = HostBytes(align64(p->small_w13_elems * c.num_experts * sizeof(bf16_t)));
    p->small_w2 = HostBytes(align64(p->small_w2_elems * c.num_experts * sizeof(bf16_t)));
  }
  if (engine == GemmEngine::kOpenBlas && c.x_dtype == DType::kBF16 && c.train) {
    p->blas_w13 = HostBytes(align64(4 * 2 * static_cast<size_t>(c.ffn_hidden) * c.hidden * c.num_experts));
    p->blas_w2 = HostBytes(align64(4 * static_cast<size_t>(c.hidden) * c.ffn_hidden * c.num_experts));
  }
  if (engine == GemmEngine::kOpenBlas || c.num_experts == 0) return p;
  const DType d = c.x_dtype;
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const int L = c.num_experts;
  p->gate_up = matmul(weight_gemm(d, H, 2 * I, true));  // w13_e [2I, H]
  p->down = matmul(weight_gemm(d, I, H, true));         // w2_e [H, I]
  p->w13_fwd = PackedTensor(*p->gate_up, L);
  p->w2_fwd = PackedTensor(*p->down, L);
  if (c.train) {
    p->down_dgrad = matmul(weight_gemm(d, H, I, false));         // [rows, H] w2_e
    p->gate_up_dgrad = matmul(weight_gemm(d, 2 * I, H, false));  // [rows, 2I] w13_e
    p->down_wgrad = matmul(wgrad_gemm(d, H, I));                 // g^T [H, rows] h [rows, I]
    p->gate_up_wgrad = matmul(wgrad_gemm(d, 2 * I, H));          // dgu^T [2I, rows] x [rows, H]
    p->down_wgrad_acc = matmul(wgrad_gemm(d, H, I, true));
    p->gate_up_wgrad_acc = matmul(wgrad_gemm(d, 2 * I, H, true));
    if (!p->down_dgrad->packed_b_is_source()) p->w2_dgrad = PackedTensor(*p->down_dgrad, L);
    if (!p->gate_up_dgrad->packed_b_is_source()) p->w13_dgrad = PackedTensor(*p->gate_up_dgrad, L);
  }
  return p;
}

namespace {

// oneDNN's packed copies of experts [first, first + count): one task per expert
// and weight. Where a bf16 weight's forward (transposed) and dgrad (as stored)
// layouts are both plain, one task makes both from a single read of the weight.
void pack_onednn_weights(ThreadPool& pool, CpuExpertWeights& p, const float* w13, const float* w2, int first,
                         int count) {
  const int64_t n13 = 2 * static_cast<int64_t>(p.cfg.ffn_hidden) * p.cfg.hidden;
  const int64_t n2 = static_cast<int64_t>(p.cfg.hidden) * p.cfg.ffn_hidden;
  struct Job {
    const OneDnnMatmul* mm;
    PackedTensor* to;
    const float* from;
    int64_t count;                  // fp32 values per expert
    PackedTensor* same = nullptr;   // the dgrad copy, made in the same pass (plain layouts)
  };
  std::vector<Job> jobs;
  auto add = [&](const OneDnnMatmul* fwd, PackedTensor* to, const OneDnnMatmul* dgrad, PackedTensor* dgrad_to,
                 const float* from, int64_t n) {
    const bool both = !dgrad_to->empty() && fwd->packed_b_is_plain() && dgrad->packed_b_is_plain();
    jobs.push_back({fwd, to, from, n, both ? dgrad_to : nullptr});
    if (!dgrad_to->empty() && !both) jobs.push_back({dgrad, dgrad_to, from, n});
  };
  add(p.gate_up.get(), &p.w13_fwd, p.gate_up_dgrad.get(), &p.w13_dgrad, w13, n13);
  add(p.down.get(), &p.w2_fwd, p.down_dgrad.get(), &p.w2_dgrad, w2, n2);
  pool.parallel_for(static_cast<int64_t>(jobs.size()) * count, [&](int64_t task, int) {
    const Job& j = jobs[task / count];
    const int e = first + static_cast<int>(task % count);
    if (j.same) {  // the forward's B is the weight [n, k] transposed
      const MatmulShape& s = j.mm->shape();
      pack_plain_b_both(j.from + j.count * e, s.n, s.k, s.dtype, j.to->expert(e), j.same->expert(e));
    } else {
      j.mm->pack_b(j.from + j.count * e, j.to->expert(e));
    }
  });
}

}  // namespace

void pack_expert_weights(ThreadPool& pool, PackedWeights& packed, const float* w13, const float* w2, int first,
                         int count) {
  auto* p = dynamic_cast<CpuExpertWeights*>(&packed);
  MOE_CHECK(p, "pack_expert_weights: the packed weights are not the CPU backend's expert weights");
  MOE_CHECK(first >= 0 && count >= 0 && first + count <= p->cfg.num_experts, "pack_expert_weights: experts [", first,
            ", ", first + count, ") are not within the ", p->cfg.num_experts, " the weights were made for");
  if (p->small_w13.get() && count > 0) {
    const int64_t H = p->cfg.hidden, I = p->cfg.ffn_hidden;
    auto* s13 = reinterpret_cast<bf16_t*>(p->small_w13.get());
    auto* s2 = reinterpret_cast<bf16_t*>(p->small_w2.get());
    pool.parallel_for(count, [&](int64_t i, int) {
      const int64_t e = first + i;
      pack_small_bf16_weights(w13 + e * 2 * I * H, 2 * I, H, s13 + e * p->small_w13_elems);
      pack_small_bf16_weights(w2 + e * H * I, H, I, s2 + e * p->small_w2_elems);
    });
  }
  if (p->blas_w13.get() && count > 0) {
    const int64_t n13 = 2 * static_cast<int64_t>(p->cfg.ffn_hidden) * p->cfg.hidden;
    const int64_t n2 = static_cast<int64_t>(p->cfg.hidden) * p->cfg.ffn_hidden;
    auto* r13 = reinterpret_cast<float*>(p->blas_w13.get());
    auto* r2 = reinterpret_cast<float*>(p->blas_w2.get());
    pool.parallel_for(2 * static_cast<int64_t>(count), [&](int64_t task, int) {
      const int64_t e = first + task / 2;
      if (task % 2 == 0)
        round_rows_to_bf16(w13 + e * n13, r13 + e * n13, n13);
      else
        round_rows_to_bf16(w2 + e * n2, r2 + e * n2, n2);
    });
  }
  if (p->gate_up && count > 0) pack_onednn_weights(pool, *p, w13, w2, first, count);
  p->packed = true;
}

namespace {

// The fused update applies where every copy is a oneDNN plain layout: the
// forward's transposed B of each weight and, where packed (bf16), its dgrad
// copy as stored, both of which pack_plain_b_rows makes a block of rows at a time.
bool plain_onednn_copies(const CpuExpertWeights& p) {
  if (!p.gate_up || p.small_w13.get() || p.blas_w13.get()) return false;
  for (const auto& [fwd, dgrad, copy] : {std::tuple{p.gate_up.get(), p.gate_up_dgrad.get(), &p.w13_dgrad},
                                         std::tuple{p.down.get(), p.down_dgrad.get(), &p.w2_dgrad}})
    if (!fwd->packed_b_is_plain() || (!copy->empty() && !dgrad->packed_b_is_plain())) return false;
  return true;
}

}  // namespace

// Tasks of one block of rows of one expert's weight: the optimizer steps the
// block's elements, then the block is packed from L2, where the step left it
// (a whole expert's weight, 8-16 MB with its gradient and moments, would not
// stay: stepping and packing whole experts measured no faster than two passes).
// 32 rows, a bf16 pack's line block: at H=1024 the four fp32 streams of a block
// take 512 KB, half a Zen 4 core's L2 (64 rows measured slower for bf16, alike
// for fp32).
void update_expert_weights(ThreadPool& pool, const OptimizerConfig& cfg, const OptimizerArgs& w13,
                           const OptimizerArgs& w2, PackedWeights& packed, int num_experts) {
  auto* p = dynamic_cast<CpuExpertWeights*>(&packed);
  MOE_CHECK(p, "update_expert_weights: the packed weights are not the CPU backend's expert weights");
  MOE_CHECK(num_experts == p->cfg.num_experts, "update_expert_weights: ", num_experts,
            " experts, the packed weights were made for ", p->cfg.num_experts);
  if (!plain_onednn_copies(*p) || num_experts == 0) {
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
    PackedTensor *forward, *dgrad;
  };
  const Weight weights[2] = {
      {&w13, prepare_optimizer(cfg, w13), 2 * I, H, &p->w13_fwd, p->w13_dgrad.empty() ? nullptr : &p->w13_dgrad},
      {&w2, prepare_optimizer(cfg, w2), H, I, &p->w2_fwd, p->w2_dgrad.empty() ? nullptr : &p->w2_dgrad}};
  const DType d = p->cfg.x_dtype;
  constexpr int64_t block = 32;
  static_assert(block % 32 == 0, "blocks start where a pack's line block does");

  const int64_t blocks13 = (2 * I + block - 1) / block, blocks2 = (H + block - 1) / block;
  pool.parallel_for(L * (blocks13 + blocks2), [&](int64_t task, int) {
    const int64_t e = task / (blocks13 + blocks2), b = task % (blocks13 + blocks2);
    const Weight& w = weights[b < blocks13 ? 0 : 1];
    const int64_t r0 = (b < blocks13 ? b : b - blocks13) * block, r1 = std::min(w.rows, r0 + block);
    const int64_t at = e * w.rows * w.cols;
    optimizer_range(w.pass, *w.args, at + r0 * w.cols, at + r1 * w.cols);
    pack_plain_b_rows(w.args->weight + at, w.rows, w.cols, d, w.forward->expert(static_cast<int>(e)),
                      w.dgrad ? w.dgrad->expert(static_cast<int>(e)) : nullptr, r0, r1);
  });
  p->packed = true;
}

const float* CpuExpertWeights::blas_w13_of(int e, const float* w13) const {
  const int64_t n13 = 2 * static_cast<int64_t>(cfg.ffn_hidden) * cfg.hidden;
  return (blas_w13.get() ? reinterpret_cast<const float*>(blas_w13.get()) : w13) + e * n13;
}

const float* CpuExpertWeights::blas_w2_of(int e, const float* w2) const {
  const int64_t n2 = static_cast<int64_t>(cfg.hidden) * cfg.ffn_hidden;
  return (blas_w2.get() ? reinterpret_cast<const float*>(blas_w2.get()) : w2) + e * n2;
}

const void* CpuExpertWeights::w13_dgrad_of(int e, const float* w13) const {
  if (!w13_dgrad.empty()) return w13_dgrad.expert(e);
  return w13 + static_cast<int64_t>(e) * 2 * cfg.ffn_hidden * cfg.hidden;
}

const void* CpuExpertWeights::w2_dgrad_of(int e, const float* w2) const {
  if (!w2_dgrad.empty()) return w2_dgrad.expert(e);
  return w2 + static_cast<int64_t>(e) * cfg.hidden * cfg.ffn_hidden;
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
