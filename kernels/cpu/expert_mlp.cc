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
//   train only: g_perm [M, H] | x_perm [M, H] | dgu [M, 2I] | h_perm [M, I]
struct MlpWorkspace {
  size_t thread_floats;
  float* base;
  float* g_perm = nullptr;
  float* x_perm = nullptr;
  float* dgu = nullptr;
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
  if (c.train) {
    const int64_t M = c.max_rows, H = c.hidden, I = c.ffn_hidden;
    ws.g_perm = ws.base + ws.thread_floats * num_threads;
    ws.x_perm = ws.g_perm + M * H;
    ws.dgu = ws.x_perm + M * H;
    ws.h_perm = ws.dgu + M * 2 * I;
  }
  return ws;
}

size_t blas_workspace_bytes(const ExpertMlpConfig& c, int num_threads) {
  size_t floats = thread_floats(c) * num_threads;
  if (c.train)
    floats += static_cast<size_t>(c.max_rows) * (2 * c.hidden + 3 * static_cast<size_t>(c.ffn_hidden));
  return floats * 4;
}

// OpenBLAS: every panel fp32 (bf16 rows converted as they are gathered).
void forward_blas(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpForwardArgs& a) {
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const MlpWorkspace ws = carve(c, a.workspace, exec.pool.num_threads());
  PhaseTotals totals;
  for_each_row_tile(exec, a.expert_offset, a.part, c.num_experts,
                    [&](const GemmTile& t, int64_t rows, int thread, PhaseClock& clock) {
    float* xp = ws.xp(c, thread);
    float* gu = a.saved_gu ? a.saved_gu + t.begin * 2 * I : ws.gup(c, thread);
    float* hp = ws.hp(c, thread);
    const float* w13 = a.w13 + static_cast<int64_t>(t.group) * 2 * I * H;
    const float* w2 = a.w2 + static_cast<int64_t>(t.group) * H * I;
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

void dgrad_blas(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a, const MlpWorkspace& ws);

void backward_blas(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a) {
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const MlpWorkspace ws = carve(c, a.workspace, exec.pool.num_threads());

  if (a.phase != MlpBackwardPhase::kWgrad) dgrad_blas(exec, c, a, ws);
  if (a.phase == MlpBackwardPhase::kDgrad) return;
  // Weight gradients: dW2_e = g_e^T h_e ([H, I]); dW13_e = dgu_e^T x_e ([2I, H]).
  GroupedGemmConfig w2cfg{GemmKind::kWgrad, c.num_experts, H, I, false};
  grouped_gemm(exec, w2cfg, {a.expert_offset, ws.g_perm, ws.h_perm, a.grad_w2});
  GroupedGemmConfig w13cfg{GemmKind::kWgrad, c.num_experts, 2 * I, H, false};
  grouped_gemm(exec, w13cfg, {a.expert_offset, ws.dgu, ws.x_perm, a.grad_w13});
}

// Row tiles of the part: the dgrad chain. dh' = g w2; SwiGLU backward gives dgu,
// the scaled h and the routing-weight gradient; dx = dgu w13. Leaves g, x, dgu and
// h per pair in the workspace for the weight gradients.
void dgrad_blas(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a, const MlpWorkspace& ws) {
  const int64_t H = c.hidden, I = c.ffn_hidden;
  PhaseTotals totals;
  for_each_row_tile(exec, a.expert_offset, a.part, c.num_experts,
                    [&](const GemmTile& t, int64_t rows, int thread, PhaseClock& clock) {
    const float* w13 = a.w13 + static_cast<int64_t>(t.group) * 2 * I * H;
    const float* w2 = a.w2 + static_cast<int64_t>(t.group) * H * I;
    float* g = ws.g_perm + t.begin * H;
    float* dgu = ws.dgu + t.begin * 2 * I;
    float* dh = ws.hp(c, thread);
    gather_rows(a.grad_rows, c.x_dtype, c.hidden, a.perm_src_row + t.begin, rows, c.max_src_rows, g);
    gather_rows(a.rows, c.x_dtype, c.hidden, a.perm_src_row + t.begin, rows, c.max_src_rows,
                ws.x_perm + t.begin * H);
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
    forward_blas(exec, c, rest);
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
    backward_blas(exec, c, a);
}

}  // namespace moe::kernels::cpu
