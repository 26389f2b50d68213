// The row-invariant GEMM of the expert MLP (docs/backends.md#row-invariant-gemm):
// C [m, n] = A [m, k] B [k, n], where every C[i, j] is computed by the same
// sequence of fp32 operations whatever m is, which rows share the call, where row
// i sits in it, and which kernel (ISA) runs it:
//
//   for each block b of kRowGemmKc consecutive k, in order:
//     p = 0; for k in the block, in order: p = fma(A[i, k], B[k, j], p)
//     C[i, j] = (b == 0 && !accumulate) ? p : C[i, j] + p
//
// So a chunked layer, a replica or a rebalance that hands an expert's rows to
// calls of other sizes leaves each row's bits alone (GEMM libraries choose
// kernels and blockings by m, and their bits with them: docs/layer.md#overlap).
// The kernels are BLIS-style: B in panels of NR columns, A packed per block of
// rows, an MR x NR register tile of fp32 accumulators (AVX2: 6 x 16; AVX-512:
// 12 x 32); fp32 and bf16 B (bf16 widened in registers, exact).
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu_isa.h"
#include "moe/kernels/types.h"

namespace moe::kernels::cpu {

// k values a block sums before adding into C; part of the result's definition
// (above), the same on every ISA.
constexpr int64_t kRowGemmKc = 256;

// The row-invariant GEMM's kernel on an ISA: AVX-512 (F) where the ISA has it.
enum class RowGemmKernel { kAvx2, kAvx512 };
RowGemmKernel row_gemm_kernel(CpuIsa isa);
inline RowGemmKernel row_gemm_kernel() { return row_gemm_kernel(cpu_isa()); }
const char* row_gemm_kernel_name(RowGemmKernel kernel);
// Columns per panel of the kernel (16 or 32).
int64_t row_gemm_nr(RowGemmKernel kernel);

// B made once (set_weights, after an optimizer step) in the panel layout of one
// kernel: ceil(n / NR) panels of [k][NR] values, zero-padded past n; in bf16 each
// row of a panel pairs column c with column c + NR/2 in one 32-bit word (low half
// c), so a vector load widens to two fp32 vectors with a shift and a mask.
struct RowGemmPanels {
  const void* data = nullptr;
  DType dtype = DType::kF32;  // fp32 or bf16
  RowGemmKernel kernel = RowGemmKernel::kAvx2;
  int64_t k = 0, n = 0;
};
// Values of B [k, n] in panels of `kernel`.
size_t row_gemm_panel_elems(RowGemmKernel kernel, int64_t k, int64_t n);
// Packs rows [row_begin, row_end) of an fp32 weight into the panels of B that
// they make: w [n, k] with B = w^T (w_nk), or w [k, n] with B = w. For w_nk the
// rows are columns of B, and a range starting at a multiple of NR packs whole
// panels (so ranges on different threads write disjoint bytes); for B = w the
// rows are rows of B. bf16 values are rounded as round_to_bf16 rounds them.
// panels: 64-byte aligned (the rows are stored around the caches, whole lines).
void pack_row_gemm_panels(RowGemmKernel kernel, const float* w, bool w_nk, int64_t k, int64_t n, DType dtype,
                          void* panels, int64_t row_begin, int64_t row_end);

// The B operand of one call: panels, or an fp32 weight that the call packs block
// by block into its scratch (rounded to bf16 values when round_bf16).
struct RowGemmB {
  int64_t k = 0, n = 0;
  const RowGemmPanels* panels = nullptr;
  const float* w = nullptr;  // [n, k] if w_nk (B = w^T), else [k, n]
  bool w_nk = false;
  bool round_bf16 = false;

  static RowGemmB of(const RowGemmPanels& p) { return {p.k, p.n, &p}; }
  static RowGemmB weight(const float* w, bool w_nk, int64_t k, int64_t n, bool round_bf16) {
    return {k, n, nullptr, w, w_nk, round_bf16};
  }
};

// Scratch bytes one call (one thread) needs for B of width up to n.
size_t row_gemm_scratch_bytes(int64_t n);

// C [m, n] (row stride ldc) = A [m, k] (row stride lda) B, on the process's
// kernel or a named one (panels must be that kernel's); with accumulate,
// C += A B (every block's sum added to C, the first one too). scratch:
// row_gemm_scratch_bytes(n), any alignment. m, n, k >= 0; k = 0 stores zeros
// (accumulate: leaves C).
void row_gemm(const float* a, int64_t m, int64_t lda, const RowGemmB& b, float* c, int64_t ldc, void* scratch,
              bool accumulate = false);
void row_gemm(RowGemmKernel kernel, const float* a, int64_t m, int64_t lda, const RowGemmB& b, float* c, int64_t ldc,
              void* scratch, bool accumulate = false);

namespace detail {
void row_gemm_avx2(const float* a, int64_t m, int64_t lda, const RowGemmB& b, float* c, int64_t ldc, void* scratch,
                   bool accumulate);
void row_gemm_avx512(const float* a, int64_t m, int64_t lda, const RowGemmB& b, float* c, int64_t ldc,
                     void* scratch, bool accumulate);
}  // namespace detail

}  // namespace moe::kernels::cpu
