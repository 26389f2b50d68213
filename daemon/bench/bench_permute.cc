#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "benches.h"
#include "moe/base/check.h"
#include "moe/base/clock.h"
#include "moe/ep/expert_stage.h"
#include "moe/ep/router_stage.h"
#include "moe/kernels/buffer.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/model/counter_rng.h"

namespace moe::bench {
namespace {

template <typename Fn>
double best_seconds(int iters, Fn&& fn) {
  fn();  // warm: first touch of every page
  double best = 1e30;
  for (int i = 0; i < iters; ++i) {
    const double t0 = now_seconds();
    fn();
    best = std::min(best, now_seconds() - t0);
  }
  return best;
}

int64_t l3_bytes() {
  const long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
  return v > 0 ? v : 32ll << 20;
}

}  // namespace

Report run_permute_bench(const PermuteBenchOptions& o) {
  MOE_CHECK(o.threads >= 1 && o.iters >= 1 && o.hidden > 0 && o.top_k >= 1 && o.experts >= o.top_k,
            "permute bench: bad options");
  kernels::ThreadPool pool(o.threads);
  auto be = kernels::make_cpu_backend(pool);
  const int64_t l3 = l3_bytes();
  const int64_t want = o.bytes > 0 ? o.bytes : std::max<int64_t>(4 * l3, 256ll << 20);
  const int64_t H = o.hidden, K = o.top_k, row_bytes = 4 * H;
  const int64_t N = (want / row_bytes + K - 1) / K;  // source rows (tokens)
  const int64_t M = N * K;                            // permuted rows

  // Uniform routing: K distinct experts per row from a keyed hash.
  std::vector<int32_t> row_expert(N * K);
  std::vector<float> row_weight(N * K, 1.0f / K);
  for (int64_t n = 0; n < N; ++n) {
    uint64_t h = model::key_hash({0x9e37, static_cast<uint64_t>(n)});
    for (int64_t k = 0; k < K; ++k) {
      int32_t e;
      bool dup;
      do {
        h = model::mix64(h + 1);
        e = static_cast<int32_t>(h % o.experts);
        dup = std::find(&row_expert[n * K], &row_expert[n * K] + k, e) != &row_expert[n * K] + k;
      } while (dup);
      row_expert[n * K + k] = e;
    }
  }
  std::vector<int64_t> offset(o.experts + 1);
  std::vector<int32_t> src(M), pos(N * K);
  kernels::PermuteLayoutConfig lc{N, o.top_k, o.experts};
  std::vector<uint8_t> lws(be->permute_layout_workspace_bytes(lc));
  be->permute_layout(lc, {row_expert.data(), nullptr, offset.data(), src.data(), nullptr, pos.data(), lws.data()});

  kernels::Buffer rows(*be, N * row_bytes), perm(*be, M * row_bytes), copy(*be, M * row_bytes),
      out(*be, N * row_bytes);
  pool.parallel_for(N, [&](int64_t n, int) {
    float* r = rows.as<float>() + n * H;
    for (int64_t h = 0; h < H; ++h) r[h] = static_cast<float>((n + h) % 97) * 0.01f;
  });

  const double t_permute = best_seconds(o.iters, [&] {
    be->permute({N, o.top_k, M, o.hidden, kernels::DType::kF32, kernels::DType::kF32},
                {rows.get(), src.data(), pos.data(), perm.get()});
  });
  const double t_unpermute = best_seconds(o.iters, [&] {
    be->unpermute({N, o.top_k, o.hidden, kernels::DType::kF32, false},
                  {perm.as<float>(), pos.data(), row_weight.data(), out.get()});
  });
  // memcpy of the permuted buffer, split over the same threads.
  const int64_t total = M * row_bytes, chunk = 1 << 22;
  const double t_memcpy = best_seconds(o.iters, [&] {
    pool.parallel_for((total + chunk - 1) / chunk, [&](int64_t c, int) {
      const int64_t b = c * chunk, len = std::min(chunk, total - b);
      std::memcpy(copy.as<uint8_t>() + b, perm.as<uint8_t>() + b, len);
    });
  });

  // Bandwidth = the bytes a row-by-row copy moves (rows read + rows written), per
  // second: permute 2M rows (whatever the implementation reads), unpermute M + N
  // rows, memcpy twice the buffer.
  const double permute_gbps = 2.0 * M * row_bytes / t_permute / 1e9;
  const double unpermute_gbps = static_cast<double>(M + N) * row_bytes / t_unpermute / 1e9;
  const double memcpy_gbps = 2.0 * total / t_memcpy / 1e9;
  Report r;
  r.add("bench", "permute");
  r.add("threads", static_cast<int64_t>(o.threads));
  r.add("hidden", H).add("top_k", K).add("experts", static_cast<int64_t>(o.experts));
  r.add("l3_bytes", l3);
  r.add("permuted_bytes", M * row_bytes);
  r.add("permute_gbps", permute_gbps);
  r.add("unpermute_gbps", unpermute_gbps);
  r.add("memcpy_gbps", memcpy_gbps);
  r.add("permute_fraction_of_memcpy", permute_gbps / memcpy_gbps);
  r.add("unpermute_fraction_of_memcpy", unpermute_gbps / memcpy_gbps);
  return r;
}

}  // namespace moe::bench
