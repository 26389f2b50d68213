// The expert MLP on the GPU as a chain of steps on the rank's stream:
//   forward:  gather x -> grouped GEMM (gate|up) -> SwiGLU x routing weight ->
//             grouped GEMM (down)
//   backward: gather grad and x -> dgrad (down) -> SwiGLU backward -> dgrad
//             (gate|up), then the two weight-gradient grouped GEMMs.
// Each step covers the call's pairs: the whole layout, or a part (a chunked
// layer, docs/layer.md#overlap) whose experts' ranges the row-wise steps run as
// runs of consecutive pairs and the GEMMs as groups of rows [begin, end). Every
// step writes only its pairs' rows, so the parts' dgrad calls leave the whole
// layout's operands in the workspace for the weight gradients.
// bf16 layers keep the GEMM operands in bf16 (x, h, grad, dgu: h and dgu rounded
// once, as the CPU's oneDNN engine does) with fp32 accumulation and outputs;
// fp32 layers stay fp32 throughout. Packed weights are the bf16 copies.
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda_ops.h"
#include "moe/base/check.h"

namespace moe::kernels::cuda {
namespace {

// Workspace (M = max_rows, xs = the storage size of x_dtype):
//   x_perm [M, H] xs | gu [M, 2I] f32 | h [M, I] xs
//   train: g_perm [M, H] xs | dh [M, I] f32 | dgu [M, 2I] xs
struct MlpWorkspace {
  void* x_perm;
  float* gu;
  void* h;
  void* g_perm = nullptr;
  float* dh = nullptr;
  void* dgu = nullptr;
};

size_t part_bytes(const ExpertMlpConfig& c, int64_t cols, size_t elem) {
  return align256(static_cast<size_t>(c.max_rows) * cols * elem);
}

MlpWorkspace carve(const ExpertMlpConfig& c, void* ws) {
  const size_t xs = dtype_size(c.x_dtype);
  const int64_t H = c.hidden, I = c.ffn_hidden;
  auto* p = static_cast<uint8_t*>(ws);
  auto take = [&](int64_t cols, size_t elem) {
    void* at = p;
    p += part_bytes(c, cols, elem);
    return at;
  };
  MlpWorkspace w;
  w.x_perm = take(H, xs);
  w.gu = static_cast<float*>(take(2 * I, 4));
  w.h = take(I, xs);
  if (c.train) {
    w.g_perm = take(H, xs);
    w.dh = static_cast<float*>(take(I, 4));
    w.dgu = take(2 * I, xs);
  }
  return w;
}

const CudaExpertWeights& checked_weights(const ExpertMlpConfig& c, const PackedWeights* packed) {
  const auto* p = dynamic_cast<const CudaExpertWeights*>(packed);
  MOE_CHECK(p, "cuda expert mlp: packed weights are missing or not the CUDA backend's");
  MOE_CHECK(p->cfg.num_experts == c.num_experts && p->cfg.hidden == c.hidden && p->cfg.ffn_hidden == c.ffn_hidden &&
                p->cfg.x_dtype == c.x_dtype,
            "cuda expert mlp: packed weights were made for another shape or dtype");
  return *p;
}

// The weights the GEMMs read: the bf16 copies in a bf16 layer, the fp32 arrays otherwise.
struct ExpertGemmWeights {
  const void* w13;
  const void* w2;
  cudaDataType_t type;
};
ExpertGemmWeights gemm_weights(const ExpertMlpConfig& c, const CudaExpertWeights& p, const float* w13,
                               const float* w2) {
  if (c.x_dtype == DType::kBF16) return {p.w13, p.w2, CUDA_R_16BF};
  return {w13, w2, CUDA_R_32F};
}

// The pairs a call computes: each expert's range, and the same as runs of
// consecutive pairs for the row-wise steps (a whole layout is one run).
struct PairRanges {
  std::vector<int64_t> begin, end;                  // [L]
  std::vector<std::pair<int64_t, int64_t>> runs;  // [first, last), non-empty, increasing
};

PairRanges pair_ranges(const ExpertMlpConfig& c, const int64_t* offset, const ExpertMlpPart& part) {
  if (!part.whole()) c.check_part(offset, part.pair_begin, part.pair_end);
  const int64_t* begin = part.whole() ? offset : part.pair_begin;
  const int64_t* end = part.whole() ? offset + 1 : part.pair_end;
  PairRanges r;
  r.begin.assign(begin, begin + c.num_experts);
  r.end.assign(end, end + c.num_experts);
  for (int e = 0; e < c.num_experts; ++e) {
    if (r.end[e] <= r.begin[e]) continue;
    if (!r.runs.empty() && r.runs.back().second == r.begin[e])
      r.runs.back().second = r.end[e];
    else
      r.runs.push_back({r.begin[e], r.end[e]});
  }
  return r;
}

// Row m of a [M, cols] array of `elem`-byte values.
template <typename T>
T* row_at(T* base, int64_t m, int64_t cols, size_t elem) {
  using Byte = std::conditional_t<std::is_const_v<T>, const uint8_t, uint8_t>;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(base) + m * cols * elem);
}
// Value m of an optional per-pair array (null stays null).
template <typename T>
T* value_at(T* v, int64_t m) {
  return v ? v + m : nullptr;
}

// Phase clocks for ExpertMlpStats: events between phases, read after the last one.
struct PhaseEvents {
  cudaEvent_t ev[5] = {};
  int n = 0;
  bool on;
  cudaStream_t stream;
  PhaseEvents(bool enabled, cudaStream_t s) : on(enabled), stream(s) {}
  ~PhaseEvents() {
    for (cudaEvent_t e : ev)
      if (e) cudaEventDestroy(e);
  }
  void mark() {
    if (!on) return;
    check(cudaEventCreate(&ev[n]), "expert mlp timing");
    check(cudaEventRecord(ev[n++], stream), "expert mlp timing");
  }
  double seconds(int from, int to) const {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, ev[from], ev[to]), "expert mlp timing");
    return ms * 1e-3;
  }
};

}  // namespace

size_t expert_mlp_workspace_bytes(const ExpertMlpConfig& c) {
  c.validate();
  const size_t xs = dtype_size(c.x_dtype);
  const int64_t H = c.hidden, I = c.ffn_hidden;
  size_t bytes = part_bytes(c, H, xs) + part_bytes(c, 2 * I, 4) + part_bytes(c, I, xs);
  if (c.train) bytes += part_bytes(c, H, xs) + part_bytes(c, I, 4) + part_bytes(c, 2 * I, xs);
  return bytes;
}

void expert_mlp_forward(CudaExec& ex, const ExpertMlpConfig& c, const ExpertMlpForwardArgs& a) {
  c.validate();
  const CudaExpertWeights& p = checked_weights(c, a.packed);
  c.check_offsets(a.expert_offset);
  const PairRanges pr = pair_ranges(c, a.expert_offset, a.part);
  if (pr.runs.empty()) return;
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const size_t xs = dtype_size(c.x_dtype);
  const MlpWorkspace w = carve(c, a.workspace);
  const ExpertGemmWeights gw = gemm_weights(c, p, a.w13, a.w2);
  const cudaDataType_t xt = cuda_type(c.x_dtype);
  float* gu = a.saved_gu ? a.saved_gu : w.gu;
  const int64_t* b = pr.begin.data();
  const int64_t* e = pr.end.data();
  PhaseEvents clock(a.stats != nullptr, ex.stream);
  clock.mark();
  for (const auto& [m0, m1] : pr.runs)
    gather_rows(ex, a.rows, c.x_dtype, c.hidden, a.perm_src_row, m0, m1 - m0, c.max_src_rows, w.x_perm);
  clock.mark();
  grouped_gemm(ex, {GemmKind::kForward, c.num_experts, 2 * I, H, false}, b, e, {w.x_perm, xt, gw.w13, gw.type, gu});
  clock.mark();
  for (const auto& [m0, m1] : pr.runs)
    swiglu_forward(ex, m1 - m0, c.ffn_hidden, gu + m0 * 2 * I, value_at(a.perm_weight, m0), row_at(w.h, m0, I, xs),
                   c.x_dtype);
  clock.mark();
  grouped_gemm(ex, {GemmKind::kForward, c.num_experts, H, I, false}, b, e, {w.h, xt, gw.w2, gw.type, a.y});
  clock.mark();
  if (a.stats) {
    check(cudaEventSynchronize(clock.ev[4]), "expert mlp timing");
    a.stats->gather_seconds += clock.seconds(0, 1);
    a.stats->gemm_seconds += clock.seconds(1, 2) + clock.seconds(3, 4);
    a.stats->swiglu_seconds += clock.seconds(2, 3);
  }
}

void expert_mlp_backward(CudaExec& ex, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a) {
  c.validate();
  MOE_CHECK(c.train, "expert mlp backward needs a config with train = true (workspace)");
  const CudaExpertWeights& p = checked_weights(c, a.packed);
  c.check_offsets(a.expert_offset);
  MOE_CHECK(a.part.whole() || a.phase == MlpBackwardPhase::kDgrad,
            "expert mlp backward: a part computes the dgrad chain only (the weight gradients sum every part)");
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const int L = c.num_experts;
  const size_t xs = dtype_size(c.x_dtype);
  const MlpWorkspace w = carve(c, a.workspace);
  const ExpertGemmWeights gw = gemm_weights(c, p, a.w13, a.w2);
  const cudaDataType_t xt = cuda_type(c.x_dtype);
  if (a.phase != MlpBackwardPhase::kWgrad) {
    const PairRanges pr = pair_ranges(c, a.expert_offset, a.part);
    const int64_t* b = pr.begin.data();
    const int64_t* e = pr.end.data();
    for (const auto& [m0, m1] : pr.runs) {
      gather_rows(ex, a.grad_rows, c.x_dtype, c.hidden, a.perm_src_row, m0, m1 - m0, c.max_src_rows, w.g_perm);
      gather_rows(ex, a.rows, c.x_dtype, c.hidden, a.perm_src_row, m0, m1 - m0, c.max_src_rows, w.x_perm);
    }
    // dh [M, I] = g w2_e; SwiGLU backward -> dgu, h (recomputed, scaled), the routing-weight gradient.
    grouped_gemm(ex, {GemmKind::kDgrad, L, H, I, false}, b, e, {w.g_perm, xt, gw.w2, gw.type, w.dh});
    for (const auto& [m0, m1] : pr.runs)
      swiglu_backward(ex, m1 - m0, c.ffn_hidden, a.saved_gu + m0 * 2 * I, w.dh + m0 * I, value_at(a.perm_weight, m0),
                      row_at(w.dgu, m0, 2 * I, xs), value_at(a.grad_perm_weight, m0), row_at(w.h, m0, I, xs), c.x_dtype);
    // grad_perm_x [M, H] = dgu w13_e.
    grouped_gemm(ex, {GemmKind::kDgrad, L, 2 * I, H, false}, b, e, {w.dgu, xt, gw.w13, gw.type, a.grad_perm_x});
  }
  if (a.phase == MlpBackwardPhase::kDgrad) return;
  // dW2_e = g_e^T h_e [H, I]; dW13_e = dgu_e^T x_e [2I, H] over every pair (zero for
  // an expert with no rows), from what the dgrad calls left in the workspace.
  grouped_gemm(ex, {GemmKind::kWgrad, L, H, I, false}, a.expert_offset, {w.g_perm, xt, w.h, xt, a.grad_w2});
  grouped_gemm(ex, {GemmKind::kWgrad, L, 2 * I, H, false}, a.expert_offset, {w.dgu, xt, w.x_perm, xt, a.grad_w13});
}

}  // namespace moe::kernels::cuda
