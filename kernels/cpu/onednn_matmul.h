// oneDNN matmul behind plain types (no oneDNN type leaves onednn_matmul.cc).
//
// Threads: Debian's oneDNN runs on OpenMP. Every thread that calls into it here
// first sets its own OpenMP team to one thread, so a primitive runs on the
// calling pool thread alone and the rank's pool stays the only parallelism (a
// daemon with D ranks on C cores still runs C threads). Primitives are built on
// the thread that makes them with the same team of one, so what they were tuned
// for is what they run with.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "moe/kernels/types.h"

namespace moe::kernels::cpu {

// A dimension given per call instead of at creation.
inline constexpr int64_t kRuntimeDim = -1;

// C[m, n] = A[m, k] B[k, n] with A and B in `dtype`, fp32 accumulation, C in
// `out_dtype`. Row-major with row strides lda/ldb/ldc in elements; trans_a means
// A is stored as its transpose [k, m] (row stride lda). m and k may be
// kRuntimeDim; n is always fixed.
struct MatmulShape {
  DType dtype = DType::kBF16;
  DType out_dtype = DType::kF32;
  int64_t m = kRuntimeDim;
  int64_t k = 0;
  int64_t n = 0;
  int64_t lda = 0;
  int64_t ldb = 0;
  int64_t ldc = 0;
  bool trans_a = false;
  bool accumulate = false;  // C += A B (oneDNN's sum post-op) instead of C = A B
};

class OneDnnMatmul {
 public:
  // Builds the primitive. Throws
  // moe::Error naming the shape when oneDNN has no implementation for it here.
  explicit OneDnnMatmul(const MatmulShape& shape);
  ~OneDnnMatmul();
  OneDnnMatmul(const OneDnnMatmul&) = delete;
  OneDnnMatmul& operator=(const OneDnnMatmul&) = delete;

  const MatmulShape& shape() const { return shape_; }
  // C = A B on the calling thread; thread-safe. m and k are the call's values of runtime dims
  // (ignored for fixed ones); m = 0 or k = 0 is the caller's business (skip, or
  // zero C): oneDNN is not called with empty shapes.
  void run(const void* a, const void* b, void* c, int64_t m, int64_t k = 0) const;
  // oneDNN's name of the implementation it chose, e.g. "gemm:jit".
  std::string impl_name() const;

 private:
  struct Impl;
  MatmulShape shape_;
  std::unique_ptr<Impl> impl_;
};

// The calling thread's OpenMP team becomes `threads` (1 for the pool's threads).
void set_onednn_team(int threads);

// oneDNN's effective ISA name on this CPU ("avx512_core_bf16", "avx2", ...).
std::string onednn_isa_name();
// Whether that ISA has bf16 dot products (avx512_core_bf16 or AMX).
bool onednn_has_bf16_dot();
// Whether oneDNN builds a bf16 (or fp32) matmul here at all.
bool onednn_matmul_available(DType dtype);

// Best GFLOP/s of `repeats` n^3 matmuls in dtype on an OpenMP team of `threads`.
double measure_onednn_gflops(DType dtype, int threads, int n, int repeats);

}  // namespace moe::kernels::cpu
