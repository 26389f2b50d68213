// sgemm wrapper, tile planning and the grouped GEMM (forward, dgrad, wgrad).
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "cpu_ops.h"
#include "moe/base/check.h"
#include "moe/kernels/cpu_backend.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace moe::kernels::cpu {
namespace {
constexpr int64_t kMinTileRows = 128;    // below this, repacking W per call dominates
constexpr int64_t kGemmMaxTileRows = 1024;
constexpr int64_t kMinWgradTileRows = 64;
constexpr int64_t kWgradTileWork = 256 * 1024;  // pairs x output rows of a wgrad tile, about

void sort_largest_first(std::vector<GemmTile>& tiles) {
  std::stable_sort(tiles.begin(), tiles.end(), [](const GemmTile& a, const GemmTile& b) {
    return a.end - a.begin > b.end - b.begin;
  });
}
}  // namespace

void init_blas_single_threaded() { openblas_set_num_threads(1); }

}  // namespace moe::kernels::cpu

namespace moe::kernels {

double measure_sgemm_gflops(int threads, int n, int repeats) {
  MOE_CHECK(threads >= 1 && n >= 1 && repeats >= 1, "measure_sgemm_gflops: bad arguments");
  const size_t elems = static_cast<size_t>(n) * n;
  std::vector<float> a(elems), b(elems), c(elems);
  for (size_t i = 0; i < elems; ++i) {
    a[i] = static_cast<float>((i * 7) % 13) * 0.01f;
    b[i] = static_cast<float>((i * 5) % 11) * 0.01f;
  }
  openblas_set_num_threads(threads);
  double best = 0.0;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    cpu::sgemm(false, true, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 2.0 * n * n * static_cast<double>(n) / s / 1e9);
  }
  openblas_set_num_threads(1);
  return best;
}

}  // namespace moe::kernels

namespace moe::kernels::cpu {

void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
           const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
           int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // BLAS leaves C untouched for k = 0 only when beta = 1
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(m), static_cast<int>(n),
              static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta,
              c, static_cast<int>(ldc));
}

void plan_row_tiles(CpuExec& exec, const int64_t* offset, int num_groups, int64_t max_rows) {
  plan_row_tiles(exec, offset, offset + 1, num_groups, max_rows);
}

void plan_row_tiles(CpuExec& exec, const int64_t* begin, const int64_t* end, int num_groups, int64_t max_rows) {
  int64_t total = 0;
  for (int g = 0; g < num_groups; ++g) total += end[g] - begin[g];
  const int64_t per_thread = ceil_div(total, 2 * static_cast<int64_t>(exec.pool.num_threads()));
  const int64_t tile = std::clamp<int64_t>(per_thread, std::min(kMinTileRows, max_rows), max_rows);
  exec.tiles.clear();
  for (int g = 0; g < num_groups; ++g) {
    const int64_t m = end[g] - begin[g];
    if (m == 0) continue;
    const int64_t pieces = ceil_div(m, tile);
    for (int64_t p = 0; p < pieces; ++p)
      exec.tiles.push_back({g, begin[g] + m * p / pieces, begin[g] + m * (p + 1) / pieces});
  }
  sort_largest_first(exec.tiles);
}

// A group's split depends on its own rows and n alone, never on the other groups
// or the thread count: an engine's sum for an element may depend on the tile's
// width, so an expert's gradient keeps its bits wherever it is hosted and beside
// whichever experts (docs/layer.md#determinism).
void plan_wgrad_tiles(CpuExec& exec, const int64_t* offset, int num_groups, int64_t n) {
  exec.tiles.clear();
  for (int g = 0; g < num_groups; ++g) {
    const int64_t m = offset[g + 1] - offset[g];
    const int64_t pieces = std::clamp<int64_t>(ceil_div(m * n, kWgradTileWork), 1,
                                               std::max<int64_t>(1, n / kMinWgradTileRows));
    for (int64_t p = 0; p < pieces; ++p) exec.tiles.push_back({g, n * p / pieces, n * (p + 1) / pieces});
  }
  // Work of a wgrad tile is rows(group) x its n range.
  std::stable_sort(exec.tiles.begin(), exec.tiles.end(), [&](const GemmTile& a, const GemmTile& b) {
    return (offset[a.group + 1] - offset[a.group]) * (a.end - a.begin) >
           (offset[b.group + 1] - offset[b.group]) * (b.end - b.begin);
  });
}

void grouped_gemm(CpuExec& exec, const GroupedGemmConfig& cfg, const GroupedGemmArgs& args) {
  cfg.validate();
  const int G = cfg.num_groups;
  const int64_t n = cfg.n, k = cfg.k;
  const int64_t* off = args.group_offset;
  for (int g = 0; g < G; ++g)
    MOE_CHECK(off[g + 1] >= off[g], "grouped gemm: group_offset must be non-decreasing (group ",
              g, ": ", off[g], " > ", off[g + 1], ")");
  const float beta = cfg.accumulate ? 1.0f : 0.0f;
  switch (cfg.kind) {
    case GemmKind::kForward:
    case GemmKind::kDgrad: {
      plan_row_tiles(exec, off, G, kGemmMaxTileRows);
      const bool fwd = cfg.kind == GemmKind::kForward;
      const int64_t in_cols = fwd ? k : n, out_cols = fwd ? n : k;
      exec.pool.parallel_for(static_cast<int64_t>(exec.tiles.size()), [&](int64_t i, int) {
        const GemmTile t = exec.tiles[i];
        const float* w = args.b + static_cast<int64_t>(t.group) * n * k;
        // forward: C = A W^T (W [n, k]); dgrad: C = A W.
        sgemm(false, fwd, t.end - t.begin, out_cols, in_cols, 1.0f, args.a + t.begin * in_cols,
              in_cols, w, k, beta, args.c + t.begin * out_cols, out_cols);
      });
      break;
    }
    case GemmKind::kWgrad: {
      plan_wgrad_tiles(exec, off, G, n);
      exec.pool.parallel_for(static_cast<int64_t>(exec.tiles.size()), [&](int64_t i, int) {
        const GemmTile t = exec.tiles[i];
        const int64_t r0 = off[t.group], m = off[t.group + 1] - r0;
        // W_g[begin:end, :] = A_g[:, begin:end]^T D_g
        sgemm(true, false, t.end - t.begin, k, m, 1.0f, args.a + r0 * n + t.begin, n,
              args.b + r0 * k, k, beta, args.c + static_cast<int64_t>(t.group) * n * k + t.begin * k, k);
      });
      break;
    }
  }
}

}  // namespace moe::kernels::cpu
