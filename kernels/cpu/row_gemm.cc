// The row-invariant GEMM (row_gemm.h): the AVX2 kernel, the packing every kernel
// shares (B panels made once, B blocks packed per call), and the dispatch.
#include "row_gemm.h"

#include <immintrin.h>

#include "row_gemm_kernel.h"
#include "vec.h"

namespace moe::kernels::cpu {
namespace row_gemm_impl {
namespace {

struct Avx2 {
  using Reg = __m256;
  static constexpr int kLanes = 8, kMr = 6;  // 12 accumulators, 2 B vectors, 1 broadcast
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static Reg bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static void load_b(const float* p, Reg& lo, Reg& hi) {
    lo = _mm256_load_ps(p);
    hi = _mm256_load_ps(p + kLanes);
  }
  // 16 bf16, column c paired with c + 8 in word c: a shift and a mask widen both.
  static void load_b(const bf16_t* p, Reg& lo, Reg& hi) {
    const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
};

// 8 x 8 transpose of r[0..8).
void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Where a panel's fp32 rows go: a row of nr values per k, each value rounded to
// bf16 when asked. Full 8-value groups come as vectors, everything else as scalars.
// stream: panels made once and read later, written around the caches (every
// line is written whole: a row's groups come in order).
struct F32Rows {
  float* out;
  int64_t nr;
  bool round;
  bool stream = false;
  void put8(int64_t kk, int64_t j, __m256 v) const {
    if (round) v = round_bf16_ps(v);
    if (stream)
      _mm256_stream_ps(out + kk * nr + j, v);
    else
      _mm256_storeu_ps(out + kk * nr + j, v);
  }
  void put(int64_t kk, int64_t j, float v) const { out[kk * nr + j] = round ? round_to_bf16(v) : v; }
};

// One panel's rows [k0, k1) of B (columns [j0, j0 + cols) of it, cols <= nr; the
// rest of each row zero), as fp32 values through sink.put8 / put, each row's
// values in order.
template <class Sink>
void panel_rows(const RowGemmB& b, int64_t nr, int64_t j0, int64_t cols, int64_t k0, int64_t k1, const Sink& sink) {
  const int64_t kc = k1 - k0;
  if (cols < nr) {
    for (int64_t kk = 0; kk < kc; ++kk)
      for (int64_t j = 0; j < nr; ++j)
        sink.put(kk, j, j >= cols ? 0.0f : b.w_nk ? b.w[(j0 + j) * b.k + k0 + kk] : b.w[(k0 + kk) * b.n + j0 + j]);
    return;
  }
  if (!b.w_nk) {  // B = w [k, n]: each row of the panel is nr contiguous values of a row of w
    for (int64_t kk = 0; kk < kc; ++kk)
      for (int64_t j = 0; j < nr; j += 8) sink.put8(kk, j, _mm256_loadu_ps(b.w + (k0 + kk) * b.n + j0 + j));
    return;
  }
  // B = w^T, w [n, k]: 8 k values of each of the panel's nr rows of w, transposed
  // (nr / 8 8 x 8 blocks), then the 8 rows of the panel they make, one by one.
  int64_t kk = 0;
  for (; kk + 8 <= kc; kk += 8) {
    __m256 t[kMaxNr / 8][8];
    for (int64_t g = 0; g < nr / 8; ++g) {
      for (int i = 0; i < 8; ++i) t[g][i] = _mm256_loadu_ps(b.w + (j0 + g * 8 + i) * b.k + k0 + kk);
      transpose8(t[g]);
    }
    for (int i = 0; i < 8; ++i)
      for (int64_t g = 0; g < nr / 8; ++g) sink.put8(kk + i, g * 8, t[g][i]);
  }
  for (; kk < kc; ++kk)
    for (int64_t j = 0; j < nr; ++j) sink.put(kk, j, b.w[(j0 + j) * b.k + k0 + kk]);
}

// bf16 panels: each row's nr values rounded, column c paired with c + nr/2 in
// word c, the row stored when its last value comes (around the caches: panels
// are made once; a row's values come in order, eight rows apart at most).
struct Bf16Rows {
  bf16_t* out;
  int64_t nr;
  struct alignas(32) Row {
    float v[kMaxNr];
  };
  mutable Row rows[8] = {};

  void flush(int64_t kk) const {
    const float* row = rows[kk % 8].v;
    const int64_t half = nr / 2;
    auto* words = reinterpret_cast<uint32_t*>(out + kk * nr);
    for (int64_t w = 0; w < half; w += 8) {
      const __m256i lo = _mm256_castps_si256(round_bf16_ps(_mm256_load_ps(row + w)));
      const __m256i hi = _mm256_castps_si256(round_bf16_ps(_mm256_load_ps(row + half + w)));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(words + w), _mm256_or_si256(hi, _mm256_srli_epi32(lo, 16)));
    }
  }
  void put8(int64_t kk, int64_t j, __m256 v) const {
    _mm256_store_ps(rows[kk % 8].v + j, v);
    if (j + 8 == nr) flush(kk);
  }
  void put(int64_t kk, int64_t j, float v) const {
    rows[kk % 8].v[j] = v;
    if (j + 1 == nr) flush(kk);
  }
};

}  // namespace

// Eight rows at a time: 8 x 8 transposes, each k's mr values stored whole (an
// 8-row group as one vector; a group of 4 or 6 rows as 4 + 2 values).
void pack_a(const float* a, int64_t lda, int64_t rows, int64_t kc, int mr, float* out) {
  for (int64_t i0 = 0; i0 < rows; i0 += mr) {
    float* panel = out + i0 * kc;
    const int64_t r_end = std::min<int64_t>(mr, rows - i0);
    int64_t k = 0;
    for (; k + 8 <= kc; k += 8)
      for (int g = 0; g < mr; g += 8) {
        const int width = std::min(8, mr - g);
        __m256 r[8];
        for (int i = 0; i < 8; ++i)
          r[i] = g + i < r_end && i < width ? _mm256_loadu_ps(a + (i0 + g + i) * lda + k) : _mm256_setzero_ps();
        transpose8(r);
        for (int i = 0; i < 8; ++i) {
          float* dst = panel + (k + i) * mr + g;
          if (width == 8) {
            _mm256_storeu_ps(dst, r[i]);
            continue;
          }
          const __m128 lo = _mm256_castps256_ps128(r[i]);
          _mm_storeu_ps(dst, lo);  // width 4 or 6
          if (width == 6) _mm_storel_pi(reinterpret_cast<__m64*>(dst + 4), _mm256_extractf128_ps(r[i], 1));
        }
      }
    for (; k < kc; ++k)
      for (int64_t r = 0; r < r_end; ++r) panel[k * mr + r] = a[(i0 + r) * lda + k];
  }
}

void pack_b_block(const RowGemmB& b, int64_t nr, int64_t pc, int64_t kc, float* out) {
  const int64_t full = b.n / nr;
  if (!b.w_nk) {  // B = w [k, n]: read each row of w once, left to right, into every panel
    for (int64_t kk = 0; kk < kc; ++kk) {
      const float* src = b.w + (pc + kk) * b.n;
      for (int64_t p = 0; p < full; ++p)
        for (int64_t j = 0; j < nr; j += 8) {
          const __m256 v = _mm256_loadu_ps(src + p * nr + j);
          _mm256_store_ps(out + (p * kc + kk) * nr + j, b.round_bf16 ? round_bf16_ps(v) : v);
        }
    }
    if (full * nr < b.n) {
      const int64_t j0 = full * nr;
      panel_rows(b, nr, j0, b.n - j0, pc, pc + kc, F32Rows{out + full * kc * nr, nr, b.round_bf16});
    }
    return;
  }
  for (int64_t p = 0, panels = ceil_div(b.n, nr); p < panels; ++p) {
    const int64_t j0 = p * nr;
    panel_rows(b, nr, j0, std::min(nr, b.n - j0), pc, pc + kc, F32Rows{out + p * kc * nr, nr, b.round_bf16});
  }
}

}  // namespace row_gemm_impl

RowGemmKernel row_gemm_kernel(CpuIsa isa) { return isa >= CpuIsa::kAvx512 ? RowGemmKernel::kAvx512 : RowGemmKernel::kAvx2; }

const char* row_gemm_kernel_name(RowGemmKernel kernel) {
  return kernel == RowGemmKernel::kAvx512 ? "avx512" : "avx2";
}

int64_t row_gemm_nr(RowGemmKernel kernel) { return kernel == RowGemmKernel::kAvx512 ? 32 : 16; }

size_t row_gemm_panel_elems(RowGemmKernel kernel, int64_t k, int64_t n) {
  const int64_t nr = row_gemm_nr(kernel);
  return static_cast<size_t>(ceil_div(n, nr) * nr * k);
}

void pack_row_gemm_panels(RowGemmKernel kernel, const float* w, bool w_nk, int64_t k, int64_t n, DType dtype,
                          void* panels, int64_t row_begin, int64_t row_end) {
  using namespace row_gemm_impl;
  const int64_t nr = row_gemm_nr(kernel);
  MOE_CHECK(dtype == DType::kF32 || dtype == DType::kBF16, "row gemm panels: dtype must be fp32 or bf16");
  MOE_CHECK(row_begin >= 0 && row_begin <= row_end && row_end <= (w_nk ? n : k), "row gemm panels: rows [",
            row_begin, ", ", row_end, ") of a weight of ", w_nk ? n : k);
  MOE_CHECK(!w_nk || row_begin % nr == 0 || row_begin == row_end,
            "row gemm panels: a range of columns of B must start on a panel (", nr, "), not at ", row_begin);
  const RowGemmB b = RowGemmB::weight(w, w_nk, k, n, false);
  // w_nk: rows of w are columns of B, whole panels; else rows of B, in every panel.
  const int64_t p0 = w_nk ? row_begin / nr : 0, p1 = w_nk ? ceil_div(row_end, nr) : ceil_div(n, nr);
  const int64_t k0 = w_nk ? 0 : row_begin, k1 = w_nk ? k : row_end;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t j0 = p * nr, cols = std::min(nr, n - j0);
    const size_t at = static_cast<size_t>((p * k + k0) * nr);
    if (dtype == DType::kF32)
      panel_rows(b, nr, j0, cols, k0, k1, F32Rows{static_cast<float*>(panels) + at, nr, false, true});
    else
      panel_rows(b, nr, j0, cols, k0, k1, Bf16Rows{static_cast<bf16_t*>(panels) + at, nr});
  }
  _mm_sfence();  // the streamed panels are visible before they are read
}

size_t row_gemm_scratch_bytes(int64_t n) {
  using namespace row_gemm_impl;
  const int64_t n_pad = ceil_div(std::max<int64_t>(n, 1), kMaxNr) * kMaxNr;
  return align64(4 * static_cast<size_t>(kMc * kKc + kMaxMr * kMaxNr + n_pad * kKc)) + 64;  // + alignment
}

namespace detail {
void row_gemm_avx2(const float* a, int64_t m, int64_t lda, const RowGemmB& b, float* c, int64_t ldc, void* scratch,
                   bool accumulate) {
  row_gemm_impl::Kernel<row_gemm_impl::Avx2>::run(a, m, lda, b, c, ldc, scratch, accumulate);
}
}  // namespace detail

void row_gemm(RowGemmKernel kernel, const float* a, int64_t m, int64_t lda, const RowGemmB& b, float* c, int64_t ldc,
              void* scratch, bool accumulate) {
  MOE_CHECK(m >= 0 && b.k >= 0 && b.n >= 0 && lda >= b.k && ldc >= b.n, "row gemm: bad shape m=", m, " k=", b.k,
            " n=", b.n, " lda=", lda, " ldc=", ldc);
  MOE_CHECK(!(b.panels && b.w) && (b.panels || b.w || b.k == 0 || b.n == 0),
            "row gemm: B needs panels or a weight (one of them)");
  if (b.panels) {
    MOE_CHECK(b.panels->kernel == kernel, "row gemm: the panels were packed for the ",
              row_gemm_kernel_name(b.panels->kernel), " kernel, the call runs ", row_gemm_kernel_name(kernel));
    MOE_CHECK(b.panels->k == b.k && b.panels->n == b.n, "row gemm: panels of B [", b.panels->k, ", ", b.panels->n,
              "] for a call of B [", b.k, ", ", b.n, "]");
  }
  MOE_CHECK(row_gemm_kernel(cpu_isa_best()) >= kernel, "row gemm: this CPU cannot run the ",
            row_gemm_kernel_name(kernel), " kernel");
  if (kernel == RowGemmKernel::kAvx512)
    detail::row_gemm_avx512(a, m, lda, b, c, ldc, scratch, accumulate);
  else
    detail::row_gemm_avx2(a, m, lda, b, c, ldc, scratch, accumulate);
}

void row_gemm(const float* a, int64_t m, int64_t lda, const RowGemmB& b, float* c, int64_t ldc, void* scratch,
              bool accumulate) {
  row_gemm(row_gemm_kernel(), a, m, lda, b, c, ldc, scratch, accumulate);
}

}  // namespace moe::kernels::cpu
