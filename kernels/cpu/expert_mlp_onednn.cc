// The oneDNN path of the fused expert MLP: the tiles of the OpenBLAS path, with
// every GEMM operand in the compute dtype (the storage dtype x_dtype: bf16 runs
// on bf16 dot products with fp32 accumulation) and the weights packed by
// pack_expert_weights. Gathered rows are copied as they are, never converted.
//
// Numerics of the bf16 path beyond the OpenBLAS one (which rounds only the
// layer's outputs): h = w * silu(g) * u is rounded to bf16 before the down GEMM;
// in backward dgu and the scaled h are rounded to bf16 before the GEMMs that read
// them (dx = dgu w13, dW13 = dgu^T x, dW2 = g^T h). Rounding an operand moves it
// by at most 2^-9 of itself, so an output c = sum_i a_i b_i with one rounded
// operand moves by at most 2^-9 sum_i |a_i b_i|. Accumulation is fp32 throughout;
// weight gradients are fp32 sums.
#include <cstring>

#include "expert_mlp_common.h"
#include "moe/base/check.h"
#include "packed_weights.h"

namespace moe::kernels::cpu {
namespace {

// Workspace layout (es = bytes per element of the compute dtype):
//   per thread: xp [tile, H] es | gup [tile, 2I] fp32 | hp [tile, I] es | dh [tile, I] fp32
//   train only: dgu [M, 2I] es (bf16 only: fp32 keeps dgu over saved_gu) | h_perm [M, I] es
// xp holds a tile's gathered rows: x in forward, the output gradient g in dgrad,
// and g or x again for each row chunk of the weight gradients (no [M, H] copy of
// either is kept).
struct Layout {
  size_t es, xp, gup, hp, dh, thread;  // per-thread region sizes in bytes
  size_t dgu, h_perm;                  // train region sizes in bytes

  explicit Layout(const ExpertMlpConfig& c) : es(dtype_size(c.x_dtype)) {
    const size_t tile = kMlpMaxTileRows, H = c.hidden, I = c.ffn_hidden, M = c.max_rows;
    xp = align64(tile * H * es);
    gup = align64(tile * 2 * I * 4);
    hp = align64(tile * I * es);
    dh = align64(tile * I * 4);
    thread = xp + gup + hp + dh;
    dgu = c.train && es != sizeof(float) ? align64(M * 2 * I * es) : 0;
    h_perm = c.train ? align64(M * I * es) : 0;
  }
  size_t bytes(int num_threads) const { return thread * num_threads + dgu + h_perm; }
};

struct Workspace {
  Layout lay;
  uint8_t* base;
  uint8_t* dgu;
  uint8_t* h_perm;

  Workspace(const ExpertMlpConfig& c, void* ws, int num_threads) : lay(c), base(static_cast<uint8_t*>(ws)) {
    dgu = base + lay.thread * num_threads;
    h_perm = dgu + lay.dgu;
  }
  uint8_t* xp(int t) const { return base + lay.thread * t; }
  // dgu per pair: an fp32 layer's over saved_gu (each row's gu is read before its
  // dgu is stored, and nothing reads gu after the dgrad), a bf16 one's in dgu.
  uint8_t* dgu_of(const ExpertMlpBackwardArgs& a) const {
    return lay.es == sizeof(float) ? reinterpret_cast<uint8_t*>(a.saved_gu) : dgu;
  }
  float* gup(int t) const { return reinterpret_cast<float*>(xp(t) + lay.xp); }
  uint8_t* hp(int t) const { return xp(t) + lay.xp + lay.gup; }
  float* dh(int t) const { return reinterpret_cast<float*>(hp(t) + lay.hp); }
};

// Copies rows src[0..count) of `rows` (row_bytes each) to out, densely.
void gather_raw(const void* rows, size_t row_bytes, const int32_t* src, int64_t count, int64_t num_src_rows,
                uint8_t* out) {
  for (int64_t i = 0; i < count; ++i) {
    MOE_CHECK(src[i] >= 0 && src[i] < num_src_rows, "expert mlp: perm_src_row value ", src[i],
              " is out of range [0, ", num_src_rows, ")");
    std::memcpy(out + i * row_bytes, static_cast<const uint8_t*>(rows) + src[i] * row_bytes, row_bytes);
  }
}

// SwiGLU row kernels storing h (and dgu) in the compute dtype.
void swiglu_forward_to(DType d, const float* gu, const float* scale, uint8_t* h, int64_t rows, int I) {
  if (d == DType::kBF16)
    swiglu_forward_rows(gu, scale, reinterpret_cast<bf16_t*>(h), rows, I);
  else
    swiglu_forward_rows(gu, scale, reinterpret_cast<float*>(h), rows, I);
}

void swiglu_backward_to(DType d, const float* gu, const float* dh, const float* scale, uint8_t* dgu,
                        float* grad_scale, uint8_t* h, int64_t rows, int I) {
  if (d == DType::kBF16)
    swiglu_backward_rows(gu, dh, scale, reinterpret_cast<bf16_t*>(dgu), grad_scale, reinterpret_cast<bf16_t*>(h),
                         rows, I);
  else
    swiglu_backward_rows(gu, dh, scale, reinterpret_cast<float*>(dgu), grad_scale, reinterpret_cast<float*>(h),
                         rows, I);
}

// One operand of a weight gradient, [M, width] per pair in the compute dtype:
// stored (dgu, h), or each pair's source row (g, x: width H) gathered per row chunk.
struct WgradOperand {
  const uint8_t* stored = nullptr;
  const void* src_rows = nullptr;  // [num_src_rows, width], read through perm_src_row
  int64_t width = 0;

  // Rows [r0, r0 + rows) from column `col`: in place, or gathered into panel.
  const uint8_t* rows(const ExpertMlpConfig& c, const int32_t* perm_src_row, int64_t r0, int64_t rows, int64_t col,
                      size_t es, uint8_t* panel) const {
    if (stored) return stored + (r0 * width + col) * es;
    gather_raw(src_rows, width * es, perm_src_row + r0, rows, c.max_src_rows, panel);
    return panel + col * es;
  }
};

// W_g [n, k] (fp32, overwritten) = A_g^T D_g for every group g, A [M, n] and D
// [M, k], by row chunks (for_each_wgrad_chunk); at most one operand is gathered,
// into the thread's xp panel.
void wgrad(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& args, int64_t n, int64_t k,
           const OneDnnMatmul& store, const OneDnnMatmul& add, const WgradOperand& a, const WgradOperand& d,
           float* w, const Workspace& ws) {
  MOE_ASSERT(a.stored || d.stored);
  const size_t es = ws.lay.es;
  for_each_wgrad_chunk(exec, args.expert_offset, c.num_experts, n, k, w,
                       [&](const GemmTile& t, int64_t r0, int64_t rows, bool accumulate, float* out, int thread) {
    const uint8_t* ap = a.rows(c, args.perm_src_row, r0, rows, t.begin, es, ws.xp(thread));
    const uint8_t* dp = d.rows(c, args.perm_src_row, r0, rows, 0, es, ws.xp(thread));
    (accumulate ? add : store).run(ap, dp, out, t.end - t.begin, rows);
  });
}

}  // namespace

size_t onednn_mlp_workspace_bytes(const ExpertMlpConfig& c, int num_threads) {
  return Layout(c).bytes(num_threads);
}

void forward_onednn(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpForwardArgs& a,
                    const CpuExpertWeights& p) {
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const Workspace ws(c, a.workspace, exec.pool.num_threads());
  const size_t row_bytes = ws.lay.es * H;
  PhaseTotals totals;
  for_each_row_tile(exec, a.expert_offset, a.part, c.num_experts,
                    [&](const GemmTile& t, int64_t rows, int thread, PhaseClock& clock) {
    uint8_t* xp = ws.xp(thread);
    float* gu = a.saved_gu ? a.saved_gu + t.begin * 2 * I : ws.gup(thread);
    uint8_t* hp = ws.hp(thread);
    gather_raw(a.rows, row_bytes, a.perm_src_row + t.begin, rows, c.max_src_rows, xp);
    clock.lap(totals.gather);
    p.gate_up->run(xp, p.w13_fwd.expert(t.group), gu, rows);
    clock.lap(totals.gemm);
    swiglu_forward_to(c.x_dtype, gu, a.perm_weight ? a.perm_weight + t.begin : nullptr, hp, rows, c.ffn_hidden);
    clock.lap(totals.swiglu);
    p.down->run(hp, p.w2_fwd.expert(t.group), a.y + t.begin * H, rows);
    clock.lap(totals.gemm);
  });
  totals.flush(a.stats);
}

namespace {

// Row tiles of the part: the dgrad chain. dh' = g w2; SwiGLU backward gives dgu,
// the scaled h and the routing-weight gradient; dx = dgu w13. Leaves dgu and h per
// pair in the workspace for the weight gradients (which gather g and x again).
void dgrad_onednn(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a, const CpuExpertWeights& p,
                  const Workspace& ws) {
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const size_t es = ws.lay.es;
  PhaseTotals totals;
  for_each_row_tile(exec, a.expert_offset, a.part, c.num_experts,
                    [&](const GemmTile& t, int64_t rows, int thread, PhaseClock& clock) {
    uint8_t* g = ws.xp(thread);
    uint8_t* dgu = ws.dgu_of(a) + t.begin * 2 * I * es;
    float* dh = ws.dh(thread);
    gather_raw(a.grad_rows, H * es, a.perm_src_row + t.begin, rows, c.max_src_rows, g);
    clock.lap(totals.gather);
    p.down_dgrad->run(g, p.w2_dgrad_of(t.group, a.w2), dh, rows);
    clock.lap(totals.gemm);
    swiglu_backward_to(c.x_dtype, a.saved_gu + t.begin * 2 * I, dh, a.perm_weight ? a.perm_weight + t.begin : nullptr,
                       dgu, a.grad_perm_weight + t.begin, ws.h_perm + t.begin * I * es, rows, c.ffn_hidden);
    clock.lap(totals.swiglu);
    p.gate_up_dgrad->run(dgu, p.w13_dgrad_of(t.group, a.w13), a.grad_perm_x + t.begin * H, rows);
    clock.lap(totals.gemm);
  });
  totals.flush(a.stats);
}

}  // namespace

void backward_onednn(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a,
                     const CpuExpertWeights& p) {
  MOE_CHECK(a.phase == MlpBackwardPhase::kWgrad || (a.w13 && a.w2),
            "expert mlp backward: w13 and w2 are null (the dgrad reads them where oneDNN keeps no packed copy)");
  const Workspace ws(c, a.workspace, exec.pool.num_threads());
  if (a.phase != MlpBackwardPhase::kWgrad) dgrad_onednn(exec, c, a, p, ws);
  if (a.phase == MlpBackwardPhase::kDgrad) return;
  // Weight gradients: dW2_e = g_e^T h_e ([H, I]); dW13_e = dgu_e^T x_e ([2I, H]).
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const WgradOperand g{.src_rows = a.grad_rows, .width = H}, x{.src_rows = a.rows, .width = H};
  const WgradOperand h{.stored = ws.h_perm, .width = I}, dgu{.stored = ws.dgu_of(a), .width = 2 * I};
  wgrad(exec, c, a, H, I, *p.down_wgrad, *p.down_wgrad_acc, g, h, a.grad_w2, ws);
  wgrad(exec, c, a, 2 * I, H, *p.gate_up_wgrad, *p.gate_up_wgrad_acc, dgu, x, a.grad_w13, ws);
}

}  // namespace moe::kernels::cpu
