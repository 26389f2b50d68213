// The expert MLP's small-batch path (docs/backends.md#small-batches): an expert
// with few rows streams its weights once through the few-row kernels
// (small_gemm.h) instead of a GEMM library call that packs them for reuse that
// never comes. Per expert: gather the rows as fp32, gu = x w13^T, h = SwiGLU x
// routing weight (fp32), y = h w2^T. One task per expert.
//
// Numerics: fp32 accumulation over fp32 rows and fp32 (or bf16-rounded) weights;
// h stays fp32 except on the AVX-512 BF16 kernel, which rounds its rows, and so h,
// to bf16 (as the oneDNN bf16 path does), so every bound the engine paths meet
// holds here. A row's outputs do not depend on the other rows of its call.
#include <cstdlib>
#include <string>

#include "expert_mlp_common.h"
#include "moe/base/check.h"
#include "packed_weights.h"
#include "small_gemm.h"

namespace moe::kernels::cpu {
namespace {

// The rule's limits (rows of one expert in a layout) and the most the override may
// set: the measured crossovers (docs/backends.md#small-batches). oneDNN's bf16
// kernels beat the fp32-widening bf16 kernels above 16 rows; the AVX-512 BF16
// kernel beats them up to the cap.
constexpr int64_t kSmallRowsDefault = 32;
constexpr int64_t kSmallRowsOneDnnBf16 = 16;
constexpr int64_t kSmallRowsCap = 64;
constexpr int64_t kSmallRowsBf16Dot = kSmallRowsCap;

int64_t default_bf16_rows(const CpuEngines& engines) {
  if (small_gemm_isa() == SmallGemmIsa::kAvx512Bf16) return kSmallRowsBf16Dot;
  return engines.bf16 == GemmEngine::kOneDnn ? kSmallRowsOneDnnBf16 : kSmallRowsDefault;
}

// Per-thread panels: x [cap, H] | gu [cap, 2I] | h [cap, I], fp32.
size_t thread_panel_bytes(const ExpertMlpConfig& c) {
  return align64(4 * kSmallRowsCap * (static_cast<size_t>(c.hidden) + 3 * static_cast<size_t>(c.ffn_hidden)));
}

}  // namespace

SmallRowsRule SmallRowsRule::for_engines(const CpuEngines& engines) {
  const char* env = std::getenv("MOE_SMALL_BATCH_ROWS");
  if (!env || !*env) return {kSmallRowsDefault, default_bf16_rows(engines)};
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  MOE_CHECK(end && *end == '\0' && v >= 0 && v <= kSmallRowsCap, "MOE_SMALL_BATCH_ROWS='", env,
            "': expected an integer in [0, ", kSmallRowsCap, "] (rows per expert; 0 turns the small-batch path off)");
  return {v, v};
}

size_t small_mlp_workspace_bytes(const ExpertMlpConfig& c, int num_threads) {
  return thread_panel_bytes(c) * num_threads;
}

SmallBatchSplit split_small_batch(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpForwardArgs& a,
                                  const CpuExpertWeights& p) {
  SmallBatchSplit split;
  split.rest_part = a.part;
  split.rest = true;
  exec.small_experts.clear();
  const int64_t limit = exec.small_rows.of(c.x_dtype);
  if (limit == 0 || !p.has_small_weights()) return split;
  const int L = c.num_experts;
  exec.rest_begin.resize(L);
  exec.rest_end.resize(L);
  bool rest = false;
  for (int e = 0; e < L; ++e) {
    const int64_t b = a.part.whole() ? a.expert_offset[e] : a.part.pair_begin[e];
    const int64_t end = a.part.whole() ? a.expert_offset[e + 1] : a.part.pair_end[e];
    const int64_t layout_rows = a.expert_offset[e + 1] - a.expert_offset[e];
    const bool small = layout_rows <= limit;
    if (small && end > b) exec.small_experts.push_back(e);
    exec.rest_begin[e] = b;
    exec.rest_end[e] = small ? b : end;
    rest = rest || (!small && end > b);
  }
  if (exec.small_experts.empty()) return split;
  split.small = true;
  split.rest = rest;
  split.rest_part = {exec.rest_begin.data(), exec.rest_end.data()};
  return split;
}

void forward_small(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpForwardArgs& a,
                   const CpuExpertWeights& p, uint8_t* panels) {
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const DType wd = c.x_dtype;
  PhaseTotals totals;
  std::atomic<int64_t> pairs{0};
  exec.pool.parallel_for(static_cast<int64_t>(exec.small_experts.size()), [&](int64_t task, int thread) {
    PhaseClock clock;
    clock.start();
    const int e = exec.small_experts[task];
    const int64_t b = a.part.whole() ? a.expert_offset[e] : a.part.pair_begin[e];
    const int64_t rows = (a.part.whole() ? a.expert_offset[e + 1] : a.part.pair_end[e]) - b;
    auto* xp = reinterpret_cast<float*>(panels + thread_panel_bytes(c) * thread);
    float* gu = a.saved_gu ? a.saved_gu + b * 2 * I : xp + kSmallRowsCap * H;
    float* hp = xp + kSmallRowsCap * (H + 2 * I);
    gather_rows(a.rows, wd, c.hidden, a.perm_src_row + b, rows, c.max_src_rows, xp);
    clock.lap(totals.gather);
    small_rows_gemm(xp, rows, H, p.small_expert_w13(e, a.w13), wd, 2 * I, gu, 2 * I);
    clock.lap(totals.gemm);
    swiglu_forward_rows(gu, a.perm_weight ? a.perm_weight + b : nullptr, hp, rows, c.ffn_hidden);
    clock.lap(totals.swiglu);
    small_rows_gemm(hp, rows, I, p.small_expert_w2(e, a.w2), wd, H, a.y + b * H, H);
    clock.lap(totals.gemm);
    pairs.fetch_add(rows, std::memory_order_relaxed);
  });
  totals.flush(a.stats);
  if (a.stats) a.stats->small_batch_pairs += pairs.load();
}

}  // namespace moe::kernels::cpu
