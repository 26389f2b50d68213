// The fused expert MLP: per row tile of one expert, gather -> GEMM (gate|up) ->
// SwiGLU x routing weight -> GEMM (down), with the tile's intermediates in
// per-thread panels. Backward runs the dgrad chain per row tile, then the
// weight gradients per expert (tiles over W's rows, so no two tasks share output).
// This file holds the OpenBLAS path (fp32 panels) and the entry points, which run
// the path of the packed weights' engine (the oneDNN one is expert_mlp_onednn.cc).
#include <cstring>

#include "cpu_ops.h"
#include "expert_mlp_common.h"
#include "moe/base/check.h"
#include "packed_weights.h"
#include "vec.h"

namespace moe::kernels::cpu {

void gather_rows(const void* rows, DType dtype, int H, const int32_t* src, int64_t count,
                 int64_t num_src_rows, float* out) {
  const size_t row_bytes = dtype_size(dtype) * H;
  for (int64_t i = 0; i < count; ++i) {
    MOE_CHECK(src[i] >= 0 && src[i] < num_src_rows, "expert mlp: perm_src_row value ", src[i],
              " is out of range [0, ", num_src_rows, ")");
    load_row_f32(static_cast<const uint8_t*>(rows) + src[i] * row_bytes, dtype, out + i * H, H);
  }
}

namespace {

// Workspace layout:
//   per thread: xp [tile, H] | gup [tile, 2I] | hp [tile, I]
//   train only: h_perm [M, I] (dgu is stored over saved_gu: each row's gu is read
//   before its dgu is stored, and nothing reads gu after the dgrad)
// xp holds a tile's gathered rows: x in forward, the output gradient g in dgrad,
// g or x again for each row chunk of the weight gradients.
struct MlpWorkspace {
  size_t thread_floats;
  float* base;
  float* h_perm = nullptr;

  float* xp(const ExpertMlpConfig&, int t) const { return base + t * thread_floats; }
  float* gup(const ExpertMlpConfig& c, int t) const { return xp(c, t) + kMlpMaxTileRows * c.hidden; }
  float* hp(const ExpertMlpConfig& c, int t) const {
    return gup(c, t) + kMlpMaxTileRows * 2 * static_cast<int64_t>(c.ffn_hidden);
  }
};

size_t thread_floats(const ExpertMlpConfig& c) {
  return align64(4 * kMlpMaxTileRows * (static_cast<size_t>(c.hidden) + 3 * c.ffn_hidden)) / 4;
}

MlpWorkspace carve(const ExpertMlpConfig& c, void* workspace, int num_threads) {
  MlpWorkspace ws;
  ws.thread_floats = thread_floats(c);
  ws.base = static_cast<float*>(workspace);
  if (c.train) ws.h_perm = ws.base + ws.thread_floats * num_threads;
  return ws;
}

size_t blas_workspace_bytes(const ExpertMlpConfig& c, int num_threads) {
  size_t floats = thread_floats(c) * num_threads;
  if (c.train) floats += static_cast<size_t>(c.max_rows) * c.ffn_hidden;
  return floats * 4;
}

// One fp32 operand of a weight gradient, [M, width] per pair: stored (dgu, h), or
// each pair's source row (g, x: width H, in x_dtype) gathered per row chunk.
struct WgradRows {
  const float* stored = nullptr;
  const void* src_rows = nullptr;
  int64_t width = 0;

  const float* rows(const ExpertMlpConfig& c, const int32_t* perm_src_row, int64_t r0, int64_t rows, int64_t col,
                    float* panel) const {
    if (stored) return stored + r0 * width + col;
    gather_rows(src_rows, c.x_dtype, static_cast<int>(width), perm_src_row + r0, rows, c.max_src_rows, panel);
    return panel + col;
  }
};

// W_g [n, k] = A_g^T D_g by row chunks (for_each_wgrad_chunk), sgemm with beta 0
// for the first chunk and 1 after; at most one operand is gathered, into xp.
void wgrad_blas(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& args, int64_t n, int64_t k,
                const WgradRows& a, const WgradRows& d, float* w, const MlpWorkspace& ws) {
  MOE_ASSERT(a.stored || d.stored);
  for_each_wgrad_chunk(exec, args.expert_offset, c.num_experts, n, k, w,
                       [&](const GemmTile& t, int64_t r0, int64_t rows, bool accumulate, float* out, int thread) {
    const float* ap = a.rows(c, args.perm_src_row, r0, rows, t.begin, ws.xp(c, thread));
    const float* dp = d.rows(c, args.perm_src_row, r0, rows, 0, ws.xp(c, thread));
    sgemm(true, false, t.end - t.begin, k, rows, 1.0f, ap, n, dp, k, accumulate ? 1.0f : 0.0f, out, k);
  });
}

// OpenBLAS: every panel fp32 (bf16 rows converted as they are gathered).
void forward_blas(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpForwardArgs& a, const CpuExpertWeights& p) {
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const MlpWorkspace ws = carve(c, a.workspace, exec.pool.num_threads());
  PhaseTotals totals;
  for_each_row_tile(exec, a.expert_offset, a.part, c.num_experts,
                    [&](const GemmTile& t, int64_t rows, int thread, PhaseClock& clock) {
    float* xp = ws.xp(c, thread);
    float* gu = a.saved_gu ? a.saved_gu + t.begin * 2 * I : ws.gup(c, thread);
    float* hp = ws.hp(c, thread);
    const float* w13 = p.blas_w13_of(t.group, a.w13);
    const float* w2 = p.blas_w2_of(t.group, a.w2);
    gather_rows(a.rows, c.x_dtype, c.hidden, a.perm_src_row + t.begin, rows, c.max_src_rows, xp);
    clock.lap(totals.gather);
    sgemm(false, true, rows, 2 * I, H, 1.0f, xp, H, w13, H, 0.0f, gu, 2 * I);
    clock.lap(totals.gemm);
    swiglu_forward_rows(gu, a.perm_weight ? a.perm_weight + t.begin : nullptr, hp, rows, c.ffn_hidden);
    clock.lap(totals.swiglu);
    sgemm(false, true, rows, H, I, 1.0f, hp, I, w2, I, 0.0f, a.y + t.begin * H, H);
    clock.lap(totals.gemm);
  });
  totals.flush(a.stats);
}

void dgrad_blas(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a, const CpuExpertWeights& p,
                const MlpWorkspace& ws);

void backward_blas(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a, const CpuExpertWeights& p) {
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const MlpWorkspace ws = carve(c, a.workspace, exec.pool.num_threads());

  if (a.phase != MlpBackwardPhase::kWgrad) dgrad_blas(exec, c, a, p, ws);
  if (a.phase == MlpBackwardPhase::kDgrad) return;
  // Weight gradients: dW2_e = g_e^T h_e ([H, I]); dW13_e = dgu_e^T x_e ([2I, H]).
  const WgradRows g{.src_rows = a.grad_rows, .width = H}, x{.src_rows = a.rows, .width = H};
  const WgradRows h{.stored = ws.h_perm, .width = I}, dgu{.stored = a.saved_gu, .width = 2 * I};
  wgrad_blas(exec, c, a, H, I, g, h, a.grad_w2, ws);
  wgrad_blas(exec, c, a, 2 * I, H, dgu, x, a.grad_w13, ws);
}

// Row tiles of the part: the dgrad chain. dh' = g w2; SwiGLU backward gives dgu,
// the scaled h and the routing-weight gradient; dx = dgu w13. Leaves dgu and h per
// pair in the workspace for the weight gradients (which gather g and x again).
void dgrad_blas(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a, const CpuExpertWeights& p,
                const MlpWorkspace& ws) {
  const int64_t H = c.hidden, I = c.ffn_hidden;
  PhaseTotals totals;
  for_each_row_tile(exec, a.expert_offset, a.part, c.num_experts,
                    [&](const GemmTile& t, int64_t rows, int thread, PhaseClock& clock) {
    const float* w13 = p.blas_w13_of(t.group, a.w13);
    const float* w2 = p.blas_w2_of(t.group, a.w2);
    float* g = ws.xp(c, thread);
    float* dgu = a.saved_gu + t.begin * 2 * I;  // over this pair's gu
    float* dh = ws.hp(c, thread);
    gather_rows(a.grad_rows, c.x_dtype, c.hidden, a.perm_src_row + t.begin, rows, c.max_src_rows, g);
    clock.lap(totals.gather);
    sgemm(false, false, rows, I, H, 1.0f, g, H, w2, I, 0.0f, dh, I);
    clock.lap(totals.gemm);
    swiglu_backward_rows(a.saved_gu + t.begin * 2 * I, dh,
                         a.perm_weight ? a.perm_weight + t.begin : nullptr, dgu,
                         a.grad_perm_weight + t.begin, ws.h_perm + t.begin * I, rows, c.ffn_hidden);
    clock.lap(totals.swiglu);
    sgemm(false, false, rows, H, 2 * I, 1.0f, dgu, 2 * I, w13, H, 0.0f, a.grad_perm_x + t.begin * H, H);
    clock.lap(totals.gemm);
  });
  totals.flush(a.stats);
}

}  // namespace

namespace {
size_t engine_workspace_bytes(const ExpertMlpConfig& c, int num_threads, GemmEngine engine) {
  return align64(engine == GemmEngine::kOneDnn ? onednn_mlp_workspace_bytes(c, num_threads)
                                               : blas_workspace_bytes(c, num_threads));
}
}  // namespace

// The engine path's workspace, then the small-batch path's panels.
size_t expert_mlp_workspace_bytes(const ExpertMlpConfig& c, int num_threads, GemmEngine engine) {
  return engine_workspace_bytes(c, num_threads, engine) + small_mlp_workspace_bytes(c, num_threads);
}

namespace {

// The packed weights say which path runs; they must be this backend's engine's.
const CpuExpertWeights& checked_for(const CpuExec& exec, const ExpertMlpConfig& c, const PackedWeights* packed,
                                    bool backward) {
  const CpuExpertWeights& p = checked_expert_weights(packed, c, backward);
  MOE_CHECK(p.engine == exec.engines.of(c.x_dtype), "expert mlp: packed weights were made for the ",
            gemm_engine_name(p.engine), " engine, the backend runs ", gemm_engine_name(exec.engines.of(c.x_dtype)),
            " for ", dtype_name(c.x_dtype));
  return p;
}

}  // namespace

void expert_mlp_forward(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpForwardArgs& a) {
  c.validate();
  const CpuExpertWeights& p = checked_for(exec, c, a.packed, false);
  c.check_offsets(a.expert_offset);
  if (!a.part.whole()) c.check_part(a.expert_offset, a.part.pair_begin, a.part.pair_end);
  const SmallBatchSplit split = split_small_batch(exec, c, a, p);
  if (split.small) {
    auto* panels = static_cast<uint8_t*>(a.workspace) + engine_workspace_bytes(c, exec.pool.num_threads(), p.engine);
    forward_small(exec, c, a, p, panels);
  }
  if (!split.rest) return;
  ExpertMlpForwardArgs rest = a;
  rest.part = split.rest_part;
  if (p.engine == GemmEngine::kOneDnn)
    forward_onednn(exec, c, rest, p);
  else
    forward_blas(exec, c, rest, p);
}

void expert_mlp_backward(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a) {
  c.validate();
  MOE_CHECK(c.train, "expert mlp backward needs a config with train = true (workspace)");
  const CpuExpertWeights& p = checked_for(exec, c, a.packed, true);
  c.check_offsets(a.expert_offset);
  if (!a.part.whole()) {
    MOE_CHECK(a.phase == MlpBackwardPhase::kDgrad, "expert mlp backward: a part computes the dgrad phase only");
    c.check_part(a.expert_offset, a.part.pair_begin, a.part.pair_end);
  }
  if (p.engine == GemmEngine::kOneDnn)
    backward_onednn(exec, c, a, p);
  else
    backward_blas(exec, c, a, p);
}

}  // namespace moe::kernels::cpu
