// Row movement: dtype conversion, permute (gather rows into expert-major order)
// and unpermute (the weighted local combine, a per-row sum in k order).
#include <cstring>

#include "cpu_ops.h"
#include "moe/kernels/check.h"
#include "vec.h"

namespace moe::kernels::cpu {
namespace {
constexpr int64_t kChunk = 1024;  // columns per stack accumulator chunk
}

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

void permute(ThreadPool& pool, const PermuteConfig& cfg, const PermuteArgs& a) {
  cfg.validate();
  const int H = cfg.hidden;
  const size_t in_row = dtype_size(cfg.in_dtype) * H, out_row = dtype_size(cfg.out_dtype) * H;
  parallel_blocks(pool, cfg.num_out_rows, 64, [&](int64_t m0, int64_t m1, int) {
    for (int64_t m = m0; m < m1; ++m) {
      const int32_t src = a.src_row[m];
      MOE_CHECK(src >= 0 && src < cfg.num_rows, "permute: src_row[", m, "] = ", src,
                " is out of range [0, ", cfg.num_rows, ")");
      const auto* s = static_cast<const uint8_t*>(a.rows) + src * in_row;
      auto* d = static_cast<uint8_t*>(a.out) + m * out_row;
      if (cfg.in_dtype == cfg.out_dtype)
        std::memcpy(d, s, in_row);
      else if (cfg.out_dtype == DType::kF32)
        load_row_f32(s, cfg.in_dtype, reinterpret_cast<float*>(d), H);
      else
        store_row_f32(reinterpret_cast<const float*>(s), d, cfg.out_dtype, H);
    }
  });
}

void unpermute(ThreadPool& pool, const UnpermuteConfig& cfg, const UnpermuteArgs& a) {
  cfg.validate();
  const int K = cfg.top_k, H = cfg.hidden;
  const size_t out_row = dtype_size(cfg.out_dtype) * H;
  parallel_blocks(pool, cfg.num_rows, 32, [&](int64_t n0, int64_t n1, int) {
    alignas(64) float acc[kChunk];
    for (int64_t n = n0; n < n1; ++n) {
      const int32_t* pos = a.pair_pos + n * K;
      const float* w = a.pair_weight ? a.pair_weight + n * K : nullptr;
      auto* out = static_cast<uint8_t*>(a.out) + n * out_row;
      for (int64_t c0 = 0; c0 < H; c0 += kChunk) {
        const int64_t len = std::min<int64_t>(kChunk, H - c0);
        std::memset(acc, 0, sizeof(float) * len);
        for (int k = 0; k < K; ++k) {
          if (pos[k] < 0) continue;
          axpy_row(w ? w[k] : 1.0f, a.perm + static_cast<int64_t>(pos[k]) * H + c0, acc, len);
        }
        if (cfg.accumulate) {
          axpy_row(1.0f, acc, reinterpret_cast<float*>(out) + c0, len);
        } else {
          store_row_f32(acc, out + c0 * dtype_size(cfg.out_dtype), cfg.out_dtype, len);
        }
      }
    }
  });
}

}  // namespace moe::kernels::cpu
