// The fused expert MLP's weight gradients, on the packed weights' GEMM engine:
// dW2_e = g_e^T h_e ([H, I]) and dW13_e = dgu_e^T x_e ([2I, H]) over each expert's
// pairs, in row chunks of at most kMlpMaxTileRows (for_each_wgrad_chunk), so
// their bits depend on each expert's pairs and their order only (the layout's, or
// wgrad_order's), never on how a chunked layer split its dgrad. h and dgu are what
// the dgrad stored per pair (gathered per chunk in wgrad_order's order); g and x
// are gathered again from the call's rows per chunk (no [M, H] copy of either).
//
// OpenBLAS: fp32 operands (bf16 rows widened as gathered). oneDNN: operands in the
// compute dtype, so a bf16 layer's wgrad runs on bf16 dot products with h and dgu
// rounded to bf16 (each moves by at most 2^-9 of itself, the gradient by at most
// 2^-9 of its sum of |terms|); fp32 accumulation and fp32 gradients either way.
#include <cstring>
#include <vector>

#include "expert_mlp_common.h"
#include "moe/base/check.h"
#include "packed_weights.h"

namespace moe::kernels::cpu {
namespace {

// Copies rows src[0..count) of `rows` (row_bytes each) to out, densely.
void gather_raw(const void* rows, size_t row_bytes, const int32_t* src, int64_t count, int64_t num_src_rows,
                uint8_t* out) {
  for (int64_t i = 0; i < count; ++i) {
    MOE_CHECK(src[i] >= 0 && src[i] < num_src_rows, "expert mlp: perm_src_row value ", src[i],
              " is out of range [0, ", num_src_rows, ")");
    std::memcpy(out + i * row_bytes, static_cast<const uint8_t*>(rows) + src[i] * row_bytes, row_bytes);
  }
}

// The pairs [r0, r0 + rows) of the sum: layout positions (order null: r0, r0 + 1, ...).
struct SumRows {
  const int32_t* order = nullptr;  // wgrad_order
  int64_t r0 = 0, rows = 0;
  int64_t num_pairs = 0;  // M
};

// One operand of a weight gradient, [M, width] per pair in `dtype`: stored (dgu,
// h), or each pair's source row (g, x: width H, in x_dtype) gathered per chunk,
// as dtype (fp32 for OpenBLAS: widened; the compute dtype for oneDNN: as stored).
struct WgradOperand {
  const void* stored = nullptr;
  const void* src_rows = nullptr;
  int64_t width = 0;

  // The sum's rows from column `col`: in place, or gathered into panel (`index`:
  // the thread's scratch for the source rows of an ordered sum).
  const uint8_t* rows(const ExpertMlpConfig& c, DType dtype, const int32_t* perm_src_row, const SumRows& s,
                      int64_t col, uint8_t* panel, std::vector<int32_t>& index) const {
    const size_t es = dtype_size(dtype);
    if (stored && !s.order) return static_cast<const uint8_t*>(stored) + (s.r0 * width + col) * es;
    if (stored) {
      gather_raw(stored, width * es, s.order + s.r0, s.rows, s.num_pairs, panel);
      return panel + col * es;
    }
    const int32_t* src = perm_src_row + s.r0;
    if (s.order) {
      index.resize(s.rows);
      for (int64_t i = 0; i < s.rows; ++i) index[i] = perm_src_row[s.order[s.r0 + i]];
      src = index.data();
    }
    if (dtype == c.x_dtype)
      gather_raw(src_rows, width * es, src, s.rows, c.max_src_rows, panel);
    else
      gather_rows(src_rows, c.x_dtype, static_cast<int>(width), src, s.rows, c.max_src_rows,
                  reinterpret_cast<float*>(panel));
    return panel + col * es;
  }
};

// W_g [n, k] (fp32, overwritten) = A_g^T D_g for every group g, A [M, n] and D
// [M, k], summing each group's pairs in wgrad_order's order; operands that are
// gathered go to the thread's panel, A's rows first.
template <typename Product>
void wgrad(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& args, DType dtype, int64_t n,
           int64_t k, const WgradOperand& a, const WgradOperand& d, float* w, const WgradInputs& in,
           const Product& product) {
  const size_t es = dtype_size(dtype);
  MOE_ASSERT(static_cast<size_t>(kMlpMaxTileRows * (a.width + d.width)) * es <= in.panel_bytes);
  std::vector<std::vector<int32_t>> index(exec.pool.num_threads());
  const int64_t M = args.expert_offset[c.num_experts];
  for_each_wgrad_chunk(exec, args.expert_offset, c.num_experts, n, k, w,
                       [&](const GemmTile& t, int64_t r0, int64_t rows, bool accumulate, float* out, int thread) {
    uint8_t* panel = in.panels + in.panel_bytes * thread;
    const SumRows s{.order = args.wgrad_order, .r0 = r0, .rows = rows, .num_pairs = M};
    const uint8_t* ap = a.rows(c, dtype, args.perm_src_row, s, t.begin, panel, index[thread]);
    const uint8_t* dp = d.rows(c, dtype, args.perm_src_row, s, 0, panel + rows * a.width * es, index[thread]);
    product(ap, dp, out, t.end - t.begin, rows, accumulate);
  });
}

}  // namespace

DType wgrad_operand_dtype(const ExpertMlpConfig& c, GemmEngine engine) {
  return engine == GemmEngine::kOneDnn ? c.x_dtype : DType::kF32;
}

void expert_weight_grads(CpuExec& exec, const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a,
                         const CpuExpertWeights& p, const WgradInputs& in) {
  const int64_t H = c.hidden, I = c.ffn_hidden;
  const DType dt = wgrad_operand_dtype(c, p.engine);
  const WgradOperand g{.src_rows = a.grad_rows, .width = H}, x{.src_rows = a.rows, .width = H};
  const WgradOperand h{.stored = in.h, .width = I}, dgu{.stored = in.dgu, .width = 2 * I};
  if (p.engine == GemmEngine::kOneDnn) {
    auto onednn = [](const OneDnnMatmul& store, const OneDnnMatmul& add) {
      return [&store, &add](const uint8_t* ap, const uint8_t* dp, float* out, int64_t m, int64_t rows, bool acc) {
        (acc ? add : store).run(ap, dp, out, m, rows);
      };
    };
    wgrad(exec, c, a, dt, H, I, g, h, a.grad_w2, in, onednn(*p.down_wgrad, *p.down_wgrad_acc));
    wgrad(exec, c, a, dt, 2 * I, H, dgu, x, a.grad_w13, in, onednn(*p.gate_up_wgrad, *p.gate_up_wgrad_acc));
    return;
  }
  // OpenBLAS: W [m, k_out] (+)= A^T D with A [rows, lda], D [rows, k_out].
  auto blas = [](int64_t lda, int64_t k_out) {
    return [lda, k_out](const uint8_t* ap, const uint8_t* dp, float* out, int64_t m, int64_t rows, bool acc) {
      sgemm(true, false, m, k_out, rows, 1.0f, reinterpret_cast<const float*>(ap), lda,
            reinterpret_cast<const float*>(dp), k_out, acc ? 1.0f : 0.0f, out, k_out);
    };
  };
  wgrad(exec, c, a, dt, H, I, g, h, a.grad_w2, in, blas(H, I));
  wgrad(exec, c, a, dt, 2 * I, H, dgu, x, a.grad_w13, in, blas(2 * I, H));
}

}  // namespace moe::kernels::cpu
