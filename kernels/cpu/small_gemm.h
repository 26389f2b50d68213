// Few-row GEMMs that stream a weight matrix once (docs/backends.md#small-batches):
// C[i, j] = sum_k X[i, k] W[j, k] for a handful of rows X, W [n, k] in fp32
// (row-major) or bf16 (in panels, below; widened to fp32 in registers, or
// multiplied as bf16 pairs, never materialised as fp32 in memory).
// The decode regime: a few tokens per expert, where the step's cost is reading
// the expert weights, not the flops.
//
// Every C[i, j] is summed in one fixed order (lane-strided partial sums over k,
// then a fixed reduction) whatever m and the other rows are, so a row's result
// does not depend on which rows share the call (chunked layers need this). The
// kernels differ in lane count and so in bits; a process always runs the same one
// (the CPU's features decide). On AVX-512 BF16 the bf16-weight kernel multiplies
// bf16 pairs (VDPBF16PS), so it rounds the rows to bf16 first.
#pragma once

#include <cstdint>

#include "moe/kernels/types.h"

namespace moe::kernels::cpu {

// In order of what they need; kAvx512Bf16 runs the kAvx512 kernel for fp32
// weights and its own for bf16.
enum class SmallGemmIsa { kAvx2, kAvx512, kAvx512Bf16 };

// The kernel this process runs: AVX-512 BF16 (with F, BW and VL) when the CPU has
// it, else AVX-512 (F, BW and VL), else AVX2; MOE_SMALL_GEMM_ISA (avx2 | avx512 |
// avx512-bf16, at most what the CPU has) picks a lesser one for measurements.
SmallGemmIsa small_gemm_isa();
const char* small_gemm_isa_name(SmallGemmIsa isa);
// The kernel that multiplies w_dtype weights when `isa` is chosen: kAvx512Bf16
// runs kAvx512's for fp32 weights.
SmallGemmIsa small_gemm_kernel_for(SmallGemmIsa isa, DType w_dtype);
// Whether this CPU can run the kernel of `isa` (tests run every one it can).
bool small_gemm_isa_runs_here(SmallGemmIsa isa);
// The kernel a MOE_SMALL_GEMM_ISA value asks for on a CPU whose best is `best`
// (null or empty: best); a name that is not a kernel, or one the CPU cannot run,
// throws naming the variable.
SmallGemmIsa small_gemm_isa_for(const char* requested, SmallGemmIsa best);

// bf16 weights in the layout every kernel streams, made once when the weights are
// set: panels of 8 rows, each 32 values of a row beside the other 7 rows' (one
// linear stream however few rows a call has), rows padded to a multiple of 32
// values and panels to 8 rows with zeros.
size_t small_bf16_weight_elems(int64_t n, int64_t k);
void pack_small_bf16_weights(const float* w, int64_t n, int64_t k, bf16_t* out);

// x [m, k] fp32 (row stride k); w [n, k]: fp32 row-major (row stride k), or bf16 in
// pack_small_bf16_weights' layout; c [m, n] fp32 (row stride ldc).
// m, n, k >= 0. kAvx512Bf16 with bf16 weights computes with x rounded to bf16.
void small_rows_gemm(const float* x, int64_t m, int64_t k, const void* w, DType w_dtype, int64_t n, float* c,
                     int64_t ldc);
// The same on a named kernel (tests run every one the CPU can).
void small_rows_gemm(SmallGemmIsa isa, const float* x, int64_t m, int64_t k, const void* w, DType w_dtype,
                     int64_t n, float* c, int64_t ldc);

namespace detail {
void small_rows_gemm_avx2(const float* x, int64_t m, int64_t k, const void* w, DType w_dtype, int64_t n, float* c,
                          int64_t ldc);
void small_rows_gemm_avx512(const float* x, int64_t m, int64_t k, const void* w, DType w_dtype, int64_t n, float* c,
                            int64_t ldc);
void small_rows_gemm_avx512bf16(const float* x, int64_t m, int64_t k, const bf16_t* w, int64_t n, float* c,
                                int64_t ldc);
}  // namespace detail

}  // namespace moe::kernels::cpu
