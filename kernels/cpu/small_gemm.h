// Few-row GEMMs that stream a weight matrix once (docs/backends.md#small-batches):
// C[i, j] = sum_k X[i, k] W[j, k] for a handful of rows X, W stored row-major
// [n, k] in fp32 or bf16 (bf16 widened to fp32 in registers, never in memory).
// The decode regime: a few tokens per expert, where the step's cost is reading
// the expert weights, not the flops.
//
// Every C[i, j] is summed in one fixed order (lane-strided partial sums over k,
// then a fixed reduction) whatever m and the other rows are, so a row's result
// does not depend on which rows share the call (chunked layers need this). The
// AVX-512 and AVX2 kernels differ in lane count and so in bits; a process always
// runs the same one (the CPU's features decide).
#pragma once

#include <cstdint>

#include "moe/kernels/types.h"

namespace moe::kernels::cpu {

enum class SmallGemmIsa { kAvx2, kAvx512 };

// The kernel this CPU runs: AVX-512 (F and BW) when present, else AVX2.
SmallGemmIsa small_gemm_isa();
const char* small_gemm_isa_name(SmallGemmIsa isa);

// bf16 weights in the layout the kernel of `isa` streams, made once when the
// weights are set: row-major for AVX2; for AVX-512 panels of 8 rows, each 32
// values of a row beside the other 7 rows' (one linear stream however few rows a
// call has), rows padded to a multiple of 32 values and panels to 8 rows with zeros.
size_t small_bf16_weight_elems(SmallGemmIsa isa, int64_t n, int64_t k);
void pack_small_bf16_weights(SmallGemmIsa isa, const float* w, int64_t n, int64_t k, bf16_t* out);

// x [m, k] fp32 (row stride k); w [n, k]: fp32 row-major (row stride k), or bf16 in
// pack_small_bf16_weights' layout for the same isa; c [m, n] fp32 (row stride ldc).
// m, n, k >= 0.
void small_rows_gemm(const float* x, int64_t m, int64_t k, const void* w, DType w_dtype, int64_t n, float* c,
                     int64_t ldc);
// The same on a named kernel (tests run both where the CPU can).
void small_rows_gemm(SmallGemmIsa isa, const float* x, int64_t m, int64_t k, const void* w, DType w_dtype,
                     int64_t n, float* c, int64_t ldc);

namespace detail {
void small_rows_gemm_avx2(const float* x, int64_t m, int64_t k, const void* w, DType w_dtype, int64_t n, float* c,
                          int64_t ldc);
void small_rows_gemm_avx512(const float* x, int64_t m, int64_t k, const void* w, DType w_dtype, int64_t n, float* c,
                            int64_t ldc);
}  // namespace detail

}  // namespace moe::kernels::cpu
