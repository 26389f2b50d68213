// The fused expert MLP: per row tile of one expert, gather -> GEMM (gate|up) ->
// SwiGLU x routing weight -> GEMM (down), with the tile's intermediates in
// per-thread panels. Backward runs the dgrad chain per row tile, then the weight
// gradients per expert (expert_mlp_wgrad.cc, tiles over W's rows, so no two
// tasks share output).
//
// Every GEMM of a row (forward and dgrad) is the row-invariant GEMM (row_gemm.h):
// a row's outputs are the same bits whatever rows share its tile, so a chunked
// layer, replicas and rebalances leave them alone (docs/layer.md#overlap). The
// rows are fp32 (a bf16 layer's widened as gathered) and so are h and dgu; the
// weights are the compute dtype's values (bf16-rounded in a bf16 layer), so a
// bf16 layer rounds only its outputs. One path for every row count: a decode
// step's few rows an expert stream its panels once (docs/backends.md#small-batches).
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

// Workspace layout (fp32 unless said):
//   per thread: xp [tile, H] | gup [tile, 2I] | hp [tile, I] | the row GEMM's scratch
//   train only: h_perm [M, I] and, where the weight gradients read bf16 operands
//   (oneDNN), dgu16 [M, 2I], both in wgrad_operand_dtype
// xp holds a tile's gathered rows: x in forward, the output gradient g in dgrad,
// and for each row chunk of the weight gradients the operands it gathers (g or x,
// and h or dgu in a wgrad_order), back to back over the thread's region. An fp32 dgu is stored
// over saved_gu: each row's gu is read before its dgu is stored, and nothing
// reads gu after the dgrad.
struct Layout {
  size_t xp, gup, hp, scratch, thread;  // per-thread region sizes in bytes
  size_t h_perm, dgu16;                 // train region sizes in bytes

  Layout(const ExpertMlpConfig& c, GemmEngine engine) {
    const size_t tile = kMlpMaxTileRows, H = c.hidden, I = c.ffn_hidden, M = c.max_rows;
    xp = align64(tile * H * 4);
    gup = align64(tile * 2 * I * 4);
    hp = align64(tile * I * 4);
    scratch = row_gemm_scratch_bytes(std::max<int64_t>(c.hidden, 2 * static_cast<int64_t>(c.ffn_hidden)));
    thread = xp + gup + hp + scratch;
    const size_t es = dtype_size(wgrad_operand_dtype(c, engine));
    h_perm = c.train ? align64(M * I * es) : 0;
    dgu16 = c.train && es != sizeof(float) ? align64(M * 2 * I * es) : 0;
  }
  size_t bytes(int num_threads) const { return thread * num_threads + h_perm + dgu16; }
};

struct Workspace {
  Layout lay;
  uint8_t* base;
  uint8_t* h_perm;
  uint8_t* dgu16;

  Workspace(const ExpertMlpConfig& c, GemmEngine engine, void* ws, int num_threads)
      : lay(c, engine), base(static_cast<uint8_t*>(ws)) {
    h_perm = base + lay.thread * num_threads;
    dgu16 = h_perm + lay.h_perm;
  }
  float* xp(int t) const { return reinterpret_cast<float*>(base + lay.thread * t); }
  float* gup(int t) const { return reinterpret_cast<float*>(base + lay.thread * t + lay.xp); }
  float* hp(int t) const { return reinterpret_cast<float*>(base + lay.thread * t + lay.xp + lay.gup); }
  void* scratch(int t) const { return base + lay.thread * t + lay.xp + lay.gup + lay.hp; }
};

void forward_tiles(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpForwardArgs& a, const CpuExpertWeights& p) {
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const Workspace ws(c, p.engine, a.workspace, exec.pool.num_threads());
  PhaseTotals totals;
  for_each_row_tile(exec, a.expert_offset, a.part, c.num_experts,
                    [&](const GemmTile& t, int64_t rows, int thread, PhaseClock& clock) {
    float* xp = ws.xp(thread);
    float* gu = a.saved_gu ? a.saved_gu + t.begin * 2 * I : ws.gup(thread);
    float* hp = ws.hp(thread);
    gather_rows(a.rows, c.x_dtype, c.hidden, a.perm_src_row + t.begin, rows, c.max_src_rows, xp);
    clock.lap(totals.gather);
    row_gemm(p.w13_fwd.panels.kernel, xp, rows, H, RowGemmB::of(p.w13_fwd.expert(t.group)), gu, 2 * I,
             ws.scratch(thread));
    clock.lap(totals.gemm);
    swiglu_forward_rows(gu, a.perm_weight ? a.perm_weight + t.begin : nullptr, hp, rows, c.ffn_hidden);
    clock.lap(totals.swiglu);
    row_gemm(p.w2_fwd.panels.kernel, hp, rows, I, RowGemmB::of(p.w2_fwd.expert(t.group)), a.y + t.begin * H, H,
             ws.scratch(thread));
    clock.lap(totals.gemm);
  });
  totals.flush(a.stats);
}

// Row tiles of the part: the dgrad chain. dh = g w2; the SwiGLU backward gives
// dgu (over saved_gu), the scaled h and the routing-weight gradient; dx = dgu w13.
// The weights' blocks are packed per tile (rounded to bf16 values in a bf16 layer,
// whose w13 and w2 are its fp32 masters). Leaves dgu and h per pair for the
// weight gradients, in their operand dtype.
void dgrad_tiles(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a, const CpuExpertWeights& p,
                 const Workspace& ws) {
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const bool bf16 = c.x_dtype == DType::kBF16;
  const bool wgrad_bf16 = ws.lay.dgu16 != 0;
  const RowGemmKernel kernel = p.w13_fwd.panels.kernel;
  PhaseTotals totals;
  for_each_row_tile(exec, a.expert_offset, a.part, c.num_experts,
                    [&](const GemmTile& t, int64_t rows, int thread, PhaseClock& clock) {
    const float* w13 = a.w13 + static_cast<int64_t>(t.group) * 2 * I * H;
    const float* w2 = a.w2 + static_cast<int64_t>(t.group) * H * I;
    float* g = ws.xp(thread);
    float* dh = ws.hp(thread);
    float* dgu = a.saved_gu + t.begin * 2 * I;  // over this pair's gu
    float* h = wgrad_bf16 ? ws.gup(thread) : reinterpret_cast<float*>(ws.h_perm) + t.begin * I;
    gather_rows(a.grad_rows, c.x_dtype, c.hidden, a.perm_src_row + t.begin, rows, c.max_src_rows, g);
    clock.lap(totals.gather);
    row_gemm(kernel, g, rows, H, RowGemmB::weight(w2, false, H, I, bf16), dh, I, ws.scratch(thread));
    clock.lap(totals.gemm);
    swiglu_backward_rows(a.saved_gu + t.begin * 2 * I, dh, a.perm_weight ? a.perm_weight + t.begin : nullptr, dgu,
                         a.grad_perm_weight + t.begin, h, rows, c.ffn_hidden);
    if (wgrad_bf16) {  // the bf16 operands of oneDNN's weight gradients
      store_row_f32(h, ws.h_perm + t.begin * I * 2, DType::kBF16, rows * I);
      store_row_f32(dgu, ws.dgu16 + t.begin * 2 * I * 2, DType::kBF16, rows * 2 * I);
    }
    clock.lap(totals.swiglu);
    row_gemm(kernel, dgu, rows, 2 * I, RowGemmB::weight(w13, false, 2 * I, H, bf16), a.grad_perm_x + t.begin * H, H,
             ws.scratch(thread));
    clock.lap(totals.gemm);
  });
  totals.flush(a.stats);
}

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

size_t expert_mlp_workspace_bytes(const ExpertMlpConfig& c, int num_threads, GemmEngine engine) {
  return align64(Layout(c, engine).bytes(num_threads));
}

void expert_mlp_forward(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpForwardArgs& a) {
  c.validate();
  const CpuExpertWeights& p = checked_for(exec, c, a.packed, false);
  c.check_offsets(a.expert_offset);
  if (!a.part.whole()) c.check_part(a.expert_offset, a.part.pair_begin, a.part.pair_end);
  forward_tiles(exec, c, a, p);
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
  const Workspace ws(c, p.engine, a.workspace, exec.pool.num_threads());
  if (a.phase != MlpBackwardPhase::kWgrad) {
    MOE_CHECK(a.w13 && a.w2, "expert mlp backward: w13 and w2 are null (the dgrad reads them)");
    dgrad_tiles(exec, c, a, p, ws);
  }
  if (a.phase == MlpBackwardPhase::kDgrad) return;
  const WgradInputs in{ws.h_perm, ws.lay.dgu16 ? static_cast<const void*>(ws.dgu16) : a.saved_gu,
                       reinterpret_cast<uint8_t*>(ws.xp(0)), ws.lay.thread};
  expert_weight_grads(exec, c, a, p, in);
}

}  // namespace moe::kernels::cpu
