// Row movement: dtype conversion, permute (gather rows into expert-major order)
// and unpermute (the weighted local combine, a per-row sum in k order).
#include <cmath>
#include <cstring>

#include "cpu_ops.h"
#include "moe/base/check.h"
#include "vec.h"

namespace moe::kernels::cpu {
namespace {

// Pairs per row unpermute handles: top_k of a local combine, or the rank count of
// an EP combine (top_k = R there).
constexpr int kMaxUnpermuteK = 4096;
constexpr int64_t kMinRowBlock = 64;  // rows per task at least (tasks: about 4 per thread)
// An unpermute output this large is written with non-temporal stores: it cannot
// stay in cache anyway, and streaming skips the read-for-ownership of every line.
constexpr size_t kStreamOutputBytes = size_t{64} << 20;

// memcpy for row-sized blocks: 32-byte vector moves, no library dispatch per row.
void copy_bytes(uint8_t* d, const uint8_t* s, size_t bytes) {
  size_t i = 0;
  for (; i + 32 <= bytes; i += 32)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
  if (i < bytes) std::memcpy(d + i, s + i, bytes - i);
}

}  // namespace

void convert(ThreadPool& pool, const void* src, DType src_dtype, void* dst, DType dst_dtype,
             int64_t count) {
  const size_t in_size = dtype_size(src_dtype), out_size = dtype_size(dst_dtype);
  parallel_blocks(pool, count, 1 << 16, [&](int64_t i0, int64_t i1, int) {
    const auto* s = static_cast<const uint8_t*>(src) + i0 * in_size;
    auto* d = static_cast<uint8_t*>(dst) + i0 * out_size;
    if (src_dtype == dst_dtype) {
      std::memcpy(d, s, (i1 - i0) * in_size);
    } else if (dst_dtype == DType::kF32) {
      load_row_f32(s, src_dtype, reinterpret_cast<float*>(d), i1 - i0);
    } else {
      store_row_f32(reinterpret_cast<const float*>(s), d, dst_dtype, i1 - i0);
    }
  });
}

void add(ThreadPool& pool, void* dst, const void* src, DType dtype, int64_t count) {
  parallel_blocks(pool, count, 1 << 14, [&](int64_t i0, int64_t i1, int) {
    if (dtype == DType::kF32) {
      float* d = static_cast<float*>(dst);
      const float* s = static_cast<const float*>(src);
      for (int64_t i = i0; i < i1; ++i) d[i] += s[i];
      return;
    }
    auto* d = static_cast<bf16_t*>(dst);
    const auto* s = static_cast<const bf16_t*>(src);
    for (int64_t i = i0; i < i1; ++i) d[i] = f32_to_bf16(bf16_to_f32(d[i]) + bf16_to_f32(s[i]));
  });
}

namespace {

// types.h#fp8 wire rows: e4m3 bytes, then the groups' fp32 scales.
void quantize_fp8_rows(ThreadPool& pool, const void* rows, DType dtype, int64_t num_rows, int hidden, void* wire) {
  const size_t in_bytes = dtype_size(dtype) * hidden, out_bytes = fp8_row_bytes(hidden);
  const int64_t groups = fp8_groups(hidden);
  parallel_blocks(pool, num_rows, 64, [&](int64_t r0, int64_t r1, int) {
    std::vector<float> x(hidden);
    for (int64_t r = r0; r < r1; ++r) {
      load_row_f32(static_cast<const uint8_t*>(rows) + r * in_bytes, dtype, x.data(), hidden);
      auto* out = static_cast<uint8_t*>(wire) + r * out_bytes;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t i0 = g * kFp8GroupSize, i1 = std::min<int64_t>(hidden, i0 + kFp8GroupSize);
        float amax = 0;
        for (int64_t i = i0; i < i1; ++i) amax = std::max(amax, std::fabs(x[i]));  // NaN: skipped here, kept below
        const float scale = amax > 0 ? amax / kFp8Max : 1.0f;
        for (int64_t i = i0; i < i1; ++i) out[i] = f32_to_e4m3(x[i] / scale);
        std::memcpy(out + hidden + 4 * g, &scale, 4);
      }
    }
  });
}

void dequantize_fp8_rows(ThreadPool& pool, const void* wire, int64_t num_rows, int hidden, void* rows, DType dtype) {
  const size_t in_bytes = fp8_row_bytes(hidden), out_bytes = dtype_size(dtype) * hidden;
  const int64_t groups = fp8_groups(hidden);
  parallel_blocks(pool, num_rows, 64, [&](int64_t r0, int64_t r1, int) {
    std::vector<float> x(hidden);
    for (int64_t r = r0; r < r1; ++r) {
      const auto* in = static_cast<const uint8_t*>(wire) + r * in_bytes;
      for (int64_t g = 0; g < groups; ++g) {
        float scale;
        std::memcpy(&scale, in + hidden + 4 * g, 4);
        const int64_t i0 = g * kFp8GroupSize, i1 = std::min<int64_t>(hidden, i0 + kFp8GroupSize);
        for (int64_t i = i0; i < i1; ++i) x[i] = e4m3_to_f32(in[i]) * scale;
      }
      store_row_f32(x.data(), static_cast<uint8_t*>(rows) + r * out_bytes, dtype, hidden);
    }
  });
}

}  // namespace

void pack_rows(ThreadPool& pool, WireFormat f, const void* rows, DType dtype, int64_t num_rows, int hidden, void* wire) {
  switch (f) {
    case WireFormat::kF32:
    case WireFormat::kBF16: return convert(pool, rows, dtype, wire, wire_info(f).dtype, num_rows * hidden);
    case WireFormat::kFP8: return quantize_fp8_rows(pool, rows, dtype, num_rows, hidden, wire);
  }
  detail::fail("pack_rows: invalid wire format ", static_cast<int>(f));
}

void unpack_rows(ThreadPool& pool, WireFormat f, const void* wire, int64_t num_rows, int hidden, void* rows,
                 DType dtype) {
  switch (f) {
    case WireFormat::kF32:
    case WireFormat::kBF16: return convert(pool, wire, wire_info(f).dtype, rows, dtype, num_rows * hidden);
    case WireFormat::kFP8: return dequantize_fp8_rows(pool, wire, num_rows, hidden, rows, dtype);
  }
  detail::fail("unpack_rows: invalid wire format ", static_cast<int>(f));
}

void permute(ThreadPool& pool, const PermuteConfig& cfg, const PermuteArgs& a) {
  cfg.validate();
  const int H = cfg.hidden, K = cfg.top_k;
  const int64_t N = cfg.num_rows, M = cfg.num_out_rows;
  const size_t in_row = dtype_size(cfg.in_dtype) * H, out_row = dtype_size(cfg.out_dtype) * H;
  for (int64_t p = 0; p < N * K; ++p)
    MOE_CHECK(a.pair_pos[p] >= -1 && a.pair_pos[p] < M, "permute: pair_pos[", p / K, ",", p % K,
              "] = ", a.pair_pos[p], " is out of range [0, ", M, ")");
  // Scatter: each source row is read once (sequentially) and written to each of
  // its pairs. (Measured: a few large blocks per thread beat many small ones.)
  parallel_blocks(pool, N, kMinRowBlock, [&](int64_t n0, int64_t n1, int) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* s = static_cast<const uint8_t*>(a.rows) + n * in_row;
      for (int k = 0; k < K; ++k) {
        const int32_t m = a.pair_pos[n * K + k];
        if (m < 0) continue;
        auto* d = static_cast<uint8_t*>(a.out) + m * out_row;
        if (cfg.in_dtype == cfg.out_dtype)
          copy_bytes(d, s, in_row);
        else if (cfg.out_dtype == DType::kF32)
          load_row_f32(s, cfg.in_dtype, reinterpret_cast<float*>(d), H);
        else
          store_row_f32(reinterpret_cast<const float*>(s), d, cfg.out_dtype, H);
      }
    }
  });
}

namespace {

template <DType kIn>
inline __m256 load8(const void* base, int64_t i) {
  if constexpr (kIn == DType::kF32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  else return load_bf16_ps(static_cast<const bf16_t*>(base) + i);
}

template <DType kIn>
inline float load1(const void* base, int64_t i) {
  if constexpr (kIn == DType::kF32) return static_cast<const float*>(base)[i];
  else return bf16_to_f32(static_cast<const bf16_t*>(base)[i]);
}

enum class Store { kF32, kF32Stream, kBF16, kBF16Stream, kAccumulate };

inline void store8(Store mode, uint8_t* out, int64_t i, __m256 acc) {
  switch (mode) {
    case Store::kF32:
      _mm256_storeu_ps(reinterpret_cast<float*>(out) + i, acc);
      break;
    case Store::kF32Stream:
      _mm256_stream_ps(reinterpret_cast<float*>(out) + i, acc);
      break;
    case Store::kBF16:
      store_bf16_ps(reinterpret_cast<bf16_t*>(out) + i, acc);
      break;
    case Store::kBF16Stream: {
      alignas(16) bf16_t tmp[8];
      store_bf16_ps(tmp, acc);
      _mm_stream_si128(reinterpret_cast<__m128i*>(reinterpret_cast<bf16_t*>(out) + i),
                       _mm_load_si128(reinterpret_cast<const __m128i*>(tmp)));
      break;
    }
    case Store::kAccumulate: {
      float* o = reinterpret_cast<float*>(out) + i;
      _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc));
      break;
    }
  }
}

// out[i] = sum_c w[c] * src[c][i] over one row, in c order. kCount > 0 fixes the
// number of pairs at compile time (the loop over pairs unrolls); 0 reads `count`.
template <DType kIn, int kCount>
void sum_row(const uint8_t* const* src, const float* w, int count, int64_t H, Store mode, uint8_t* out) {
  const int n = kCount > 0 ? kCount : count;
  __m256 wv[kCount > 0 ? kCount : 1];  // broadcast weights, hoisted when the count is fixed
  if constexpr (kCount > 0)
    for (int c = 0; c < kCount; ++c) wv[c] = _mm256_set1_ps(w[c]);
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int c = 0; c < n; ++c)
      acc = _mm256_fmadd_ps(kCount > 0 ? wv[c] : _mm256_set1_ps(w[c]), load8<kIn>(src[c], i), acc);
    store8(mode, out, i, acc);
  }
  for (; i < H; ++i) {
    float acc = 0.0f;
    for (int c = 0; c < n; ++c) acc = std::fma(w[c], load1<kIn>(src[c], i), acc);
    if (mode == Store::kAccumulate) reinterpret_cast<float*>(out)[i] += acc;
    else if (mode == Store::kF32 || mode == Store::kF32Stream) reinterpret_cast<float*>(out)[i] = acc;
    else reinterpret_cast<bf16_t*>(out)[i] = f32_to_bf16(acc);
  }
}

template <DType kIn>
void sum_row_any(const uint8_t* const* src, const float* w, int count, int64_t H, Store mode, uint8_t* out) {
  switch (count) {
    case 1: return sum_row<kIn, 1>(src, w, count, H, mode, out);
    case 2: return sum_row<kIn, 2>(src, w, count, H, mode, out);
    case 3: return sum_row<kIn, 3>(src, w, count, H, mode, out);
    case 4: return sum_row<kIn, 4>(src, w, count, H, mode, out);
    case 6: return sum_row<kIn, 6>(src, w, count, H, mode, out);
    case 8: return sum_row<kIn, 8>(src, w, count, H, mode, out);
    default: return sum_row<kIn, 0>(src, w, count, H, mode, out);
  }
}

template <DType kIn>
void unpermute_impl(ThreadPool& pool, const UnpermuteConfig& cfg, const UnpermuteArgs& a) {
  const int K = cfg.top_k, H = cfg.hidden;
  const size_t in_row = dtype_size(kIn) * H, out_row = dtype_size(cfg.out_dtype) * H;
  const auto* perm = static_cast<const uint8_t*>(a.perm);
  const bool stream = !cfg.accumulate && cfg.num_rows * out_row >= kStreamOutputBytes && H % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(a.out) % 32 == 0 && out_row % 32 == 0;
  const Store mode = cfg.accumulate                     ? Store::kAccumulate
                     : cfg.out_dtype == DType::kF32     ? (stream ? Store::kF32Stream : Store::kF32)
                                                        : (stream ? Store::kBF16Stream : Store::kBF16);
  parallel_blocks(pool, cfg.num_rows, kMinRowBlock, [&](int64_t n0, int64_t n1, int) {
    const uint8_t* src[kMaxUnpermuteK];
    float w[kMaxUnpermuteK];
    for (int64_t n = n0; n < n1; ++n) {
      // The first two lines of the rows of the token two ahead start arriving while
      // this one is summed; the hardware prefetcher follows from there (measured:
      // more lines or a longer distance are slower).
      if (n + 2 < n1)
        for (int k = 0; k < K; ++k) {
          const int32_t p = a.pair_pos[(n + 2) * K + k];
          if (p < 0) continue;
          const char* row = reinterpret_cast<const char*>(perm + p * in_row);
          _mm_prefetch(row, _MM_HINT_T0);
          _mm_prefetch(row + 64, _MM_HINT_T0);
        }
      int count = 0;
      for (int k = 0; k < K; ++k) {
        const int32_t p = a.pair_pos[n * K + k];
        if (p < 0) continue;
        src[count] = perm + p * in_row;
        w[count++] = a.pair_weight ? a.pair_weight[n * K + k] : 1.0f;
      }
      // All pairs of the row advance together, 8 columns at a time: K concurrent
      // read streams, one write stream.
      sum_row_any<kIn>(src, w, count, H, mode, static_cast<uint8_t*>(a.out) + n * out_row);
    }
    if (mode == Store::kF32Stream || mode == Store::kBF16Stream) _mm_sfence();  // visible before we return
  });
}

}  // namespace

void unpermute(ThreadPool& pool, const UnpermuteConfig& cfg, const UnpermuteArgs& a) {
  cfg.validate();
  MOE_CHECK(cfg.top_k <= kMaxUnpermuteK, "unpermute: top_k ", cfg.top_k, " exceeds ", kMaxUnpermuteK);
  if (cfg.in_dtype == DType::kF32) unpermute_impl<DType::kF32>(pool, cfg, a);
  else unpermute_impl<DType::kBF16>(pool, cfg, a);
}

}  // namespace moe::kernels::cpu
