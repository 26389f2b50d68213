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

// dst [k, n] = w^T for w [n, k] in blocks of kRows rows of w (one 64-byte line of
// dst: 16 fp32 or 32 bf16) by 16 columns, each four or eight 8x8 transposes
// through an L1 tile; then the edges one value at a time. Each block writes its
// 16 dst lines whole, with streaming stores where dst rows are line-aligned:
// rows 4 KiB apart share a cache set, and through the cache the transpose ran
// at half the copy bandwidth (the stores' read-for-ownership and evictions).
template <typename Out>
void transpose_into(const float* w, int64_t k, int64_t n, Out* dst) {
  constexpr int64_t kRows = 64 / sizeof(Out);
  const int64_t nb = n / kRows * kRows, k16 = k / 16 * 16;
  const bool stream = reinterpret_cast<uintptr_t>(dst) % 64 == 0 && (n * sizeof(Out)) % 64 == 0;
  alignas(64) float tile[16][kRows];
  for (int64_t i = 0; i < nb; i += kRows)
    for (int64_t j = 0; j < k16; j += 16) {
      for (int bi = 0; bi < kRows; bi += 8)
        for (int bj = 0; bj < 16; bj += 8) {
          __m256 r[8];
          for (int q = 0; q < 8; ++q) r[q] = _mm256_loadu_ps(w + (i + bi + q) * k + j + bj);
          transpose8x8(r);
          for (int q = 0; q < 8; ++q) _mm256_store_ps(&tile[bj + q][bi], r[q]);
        }
      for (int q = 0; q < 16; ++q)
        for (int c = 0; c < kRows; c += 8) store8(dst + (j + q) * n + i + c, _mm256_load_ps(&tile[q][c]), stream);
    }
  if (stream) _mm_sfence();  // the streamed lines are visible before the caller's next store
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = i < nb ? k16 : 0; j < k; ++j) dst[j * n + i] = convert(w[i * k + j], dst);
}

}  // namespace

void pack_plain_b(const float* w, bool w_nk, int64_t k, int64_t n, DType dtype, void* dst) {
  if (w_nk) {
    if (dtype == DType::kF32)
      transpose_into(w, k, n, static_cast<float*>(dst));
    else
      transpose_into(w, k, n, static_cast<bf16_t*>(dst));
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
