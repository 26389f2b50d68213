// Packing an fp32 weight into a plain row-major B [k, n] in fp32 or bf16: a
// transpose (weight stored [n, k]) or a straight conversion (stored [k, n]),
// rounding to bf16 to nearest even as round_to_bf16 does. oneDNN's gemm:jit
// asks for exactly this layout for the expert and router weights; its reorder is
// a single-threaded generic kernel at about a third of the copy bandwidth, and
// the repack after every optimizer step reads and writes every weight.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_ops.h"
#include "moe/base/check.h"
#include "vec.h"

namespace moe::kernels::cpu {
namespace {

// r[0..8) = the columns of the 8x8 block whose rows are r[0..8) (in place).
inline void transpose8x8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// 8 fp32 -> 8 bf16, rounded as round_to_bf16 (NaN stays NaN).
inline __m128i rounded_bf16(__m256 v) {
  const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_ps(v)), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}

inline void store8(float* p, __m256 v, bool stream) {
  if (stream)
    _mm256_stream_ps(p, v);
  else
    _mm256_storeu_ps(p, v);
}

inline void store8(bf16_t* p, __m256 v, bool stream) {
  auto* q = reinterpret_cast<__m128i*>(p);
  if (stream)
    _mm_stream_si128(q, rounded_bf16(v));
  else
    _mm_storeu_si128(q, rounded_bf16(v));
}

inline float convert(float v, float*) { return v; }
inline bf16_t convert(float v, bf16_t*) { return f32_to_bf16(v); }

// dst [k, n] = w^T for w [n, k] in blocks of one 64-byte line of dst (kLine
// values: 16 fp32 or 32 bf16) by as many columns of w, each made of 8x8
// transposes through an L1 tile; then the edges one value at a time. Each block
// writes its dst lines whole, with streaming stores where dst rows are
// line-aligned: rows 4 KiB apart share a cache set, and through the cache the
// transpose ran at half the copy bandwidth (read-for-ownership and evictions of
// half-written lines). `same`, if given, also gets w itself in Out ([n, k]),
// written from the block while it is in L1, so w is read once for both. Only
// rows [i0, i1) of w (i0 a multiple of kLine): a part of the whole call's work.
template <typename Out>
void transpose_into(const float* w, int64_t k, int64_t n, Out* dst, Out* same, int64_t i0, int64_t i1) {
  constexpr int64_t kLine = 64 / sizeof(Out);
  const int64_t nb = std::min(n, i1) / kLine * kLine, kb = k / kLine * kLine;
  auto aligned = [](const Out* p, int64_t ld) {
    return reinterpret_cast<uintptr_t>(p) % 64 == 0 && (ld * sizeof(Out)) % 64 == 0;
  };
  const bool stream = aligned(dst, n), stream_same = same && aligned(same, k);
  alignas(64) float tile[kLine][kLine];
  for (int64_t i = i0; i < nb; i += kLine)
    for (int64_t j = 0; j < kb; j += kLine) {
      for (int bi = 0; bi < kLine; bi += 8)
        for (int bj = 0; bj < kLine; bj += 8) {
          __m256 r[8];
          for (int q = 0; q < 8; ++q) r[q] = _mm256_loadu_ps(w + (i + bi + q) * k + j + bj);
          transpose8x8(r);
          for (int q = 0; q < 8; ++q) _mm256_store_ps(&tile[bj + q][bi], r[q]);
        }
      for (int q = 0; q < kLine; ++q)
        for (int c = 0; c < kLine; c += 8) store8(dst + (j + q) * n + i + c, _mm256_load_ps(&tile[q][c]), stream);
      if (!same) continue;
      for (int q = 0; q < kLine; ++q)
        for (int c = 0; c < kLine; c += 8)
          store8(same + (i + q) * k + j + c, _mm256_loadu_ps(w + (i + q) * k + j + c), stream_same);
    }
  if (stream || stream_same) _mm_sfence();  // the streamed lines are visible before the caller's next store
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t j = i < nb ? kb : 0; j < k; ++j) {
      dst[j * n + i] = convert(w[i * k + j], dst);
      if (same) same[i * k + j] = convert(w[i * k + j], same);
    }
}

}  // namespace

int64_t plain_pack_rows(DType dtype) { return 64 / static_cast<int64_t>(dtype_size(dtype)); }

void pack_plain_b_rows(const float* w, int64_t rows, int64_t cols, DType dtype, void* transposed, void* same,
                       int64_t row_begin, int64_t row_end) {
  MOE_ASSERT(row_begin % plain_pack_rows(dtype) == 0 && row_begin <= row_end && row_end <= rows);
  if (dtype == DType::kF32)
    transpose_into(w, cols, rows, static_cast<float*>(transposed), static_cast<float*>(same), row_begin, row_end);
  else
    transpose_into(w, cols, rows, static_cast<bf16_t*>(transposed), static_cast<bf16_t*>(same), row_begin, row_end);
}

void pack_plain_b_both(const float* w, int64_t rows, int64_t cols, DType dtype, void* transposed, void* same) {
  pack_plain_b_rows(w, rows, cols, dtype, transposed, same, 0, rows);
}

void pack_plain_b(const float* w, bool w_nk, int64_t k, int64_t n, DType dtype, void* dst) {
  if (w_nk) {
    pack_plain_b_rows(w, n, k, dtype, dst, nullptr, 0, n);
    return;
  }
  if (dtype == DType::kF32) {
    std::memcpy(dst, w, 4 * k * n);
    return;
  }
  auto* out = static_cast<bf16_t*>(dst);
  const bool stream = reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  int64_t i = 0;
  for (; i + 8 <= k * n; i += 8) store8(out + i, _mm256_loadu_ps(w + i), stream);
  if (stream) _mm_sfence();
  for (; i < k * n; ++i) out[i] = f32_to_bf16(w[i]);
}

}  // namespace moe::kernels::cpu
