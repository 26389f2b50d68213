// Internal interface of the CPU backend: one free function per op (each in the
// file named after it), plus the helpers they share. CpuBackend forwards to these.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "moe/kernels/api.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/kernels/thread_pool.h"

namespace moe::kernels::cpu {

// Splits [0, n) into at most max_blocks contiguous blocks of at least min_block
// items (the last may be shorter); returns the block size.
inline int64_t block_size(int64_t n, int64_t min_block, int64_t max_blocks) {
  if (n <= 0) return 1;
  const int64_t by_count = (n + max_blocks - 1) / max_blocks;
  return std::max<int64_t>(std::min(n, min_block), by_count);
}

inline size_t align64(size_t bytes) { return (bytes + 63) & ~size_t{63}; }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Runs fn(begin, end, thread) over [0, n) in blocks: about 4 blocks per thread so
// dynamic scheduling evens out, none smaller than min_block.
template <typename Fn>
void parallel_blocks(ThreadPool& pool, int64_t n, int64_t min_block, Fn&& fn) {
  if (n <= 0) return;
  const int64_t bs = block_size(n, min_block, 4 * static_cast<int64_t>(pool.num_threads()));
  const int64_t num_blocks = ceil_div(n, bs);
  pool.parallel_for(num_blocks, [&](int64_t b, int thread) {
    const int64_t begin = b * bs;
    fn(begin, std::min(n, begin + bs), thread);
  });
}

// Row-major single-threaded sgemm: C[m,n] = alpha op(A) op(B) + beta C.
void sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
           const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
           int64_t ldc);

// Makes every BLAS call single-threaded (the pool provides the parallelism).
void init_blas_single_threaded();

// Throws unless this CPU can run `engines` (oneDNN bf16 needs AVX-512); `source`
// names where they came from in the message.
void check_engines_run_here(const CpuEngines& engines, const std::string& source);

// Host memory of the CPU backend: 64-byte aligned; 2 MiB and more are 2 MiB
// aligned and asked to use transparent huge pages. Throws on failure.
void* host_alloc(size_t bytes);
void host_free(void* p);

void convert(ThreadPool& pool, const void* src, DType src_dtype, void* dst, DType dst_dtype,
             int64_t count);
void add(ThreadPool& pool, void* dst, const void* src, DType dtype, int64_t count);
// Backend::pack_rows / unpack_rows: one case per wire format.
void pack_rows(ThreadPool& pool, WireFormat f, const void* rows, DType dtype, int64_t num_rows, int hidden, void* wire);
void unpack_rows(ThreadPool& pool, WireFormat f, const void* wire, int64_t num_rows, int hidden, void* rows,
                 DType dtype);

size_t router_workspace_bytes(const RouterConfig& cfg, int num_threads);
std::unique_ptr<PackedWeights> make_router_weights(const RouterConfig& cfg, GemmEngine engine);
void pack_router_weights(ThreadPool& pool, PackedWeights& packed, const float* weight);
void router_forward(ThreadPool& pool, const RouterConfig& cfg, const RouterForwardArgs& args);
void router_backward(ThreadPool& pool, const RouterConfig& cfg, const RouterBackwardArgs& args);

size_t capacity_workspace_bytes(const CapacityConfig& cfg);
void capacity_drop(ThreadPool& pool, const CapacityConfig& cfg, const CapacityArgs& args);

size_t dispatch_layout_workspace_bytes(const DispatchLayoutConfig& cfg, int num_threads);
void dispatch_layout(ThreadPool& pool, const DispatchLayoutConfig& cfg,
                     const DispatchLayoutArgs& args);

size_t permute_layout_workspace_bytes(const PermuteLayoutConfig& cfg, int num_threads);
void permute_layout(ThreadPool& pool, const PermuteLayoutConfig& cfg,
                    const PermuteLayoutArgs& args);
void permute(ThreadPool& pool, const PermuteConfig& cfg, const PermuteArgs& args);
void unpermute(ThreadPool& pool, const UnpermuteConfig& cfg, const UnpermuteArgs& args);

// Row-range kernels of SwiGLU, used by the op and by the fused expert MLP. Out is
// float or bf16_t: the outputs h and grad_gu are stored rounded to it (computed in
// fp32 either way; grad_row_scale is always fp32). An fp32 grad_gu may be gu itself:
// each row's values are read before its gradients are stored.
template <typename Out>
void swiglu_forward_rows(const float* gu, const float* row_scale, Out* h, int64_t rows, int ffn_hidden);
template <typename Out>
void swiglu_backward_rows(const float* gu, const float* grad_h, const float* row_scale, Out* grad_gu,
                          float* grad_row_scale, Out* h, int64_t rows, int ffn_hidden);
void swiglu_forward(ThreadPool& pool, const SwigluConfig& cfg, const SwigluForwardArgs& args);
void swiglu_backward(ThreadPool& pool, const SwigluConfig& cfg, const SwigluBackwardArgs& args);

// A unit of grouped-GEMM work: rows [begin, end) of group `group` (forward,
// dgrad), or output rows [begin, end) of W_group (wgrad).
struct GemmTile {
  int32_t group;
  int64_t begin;
  int64_t end;
};

// What the GEMM-driving ops share: the pool, the engines and a tile list reused
// across calls (it only grows, so steady-state steps do not allocate).
struct CpuExec {
  CpuExec(ThreadPool& p, const CpuEngines& e) : pool(p), engines(e) {}

  ThreadPool& pool;
  CpuEngines engines;
  std::vector<GemmTile> tiles;
};

// Row tiles over groups [offset[g], offset[g+1]): each group split evenly into
// pieces of at most max_rows rows, fewer pieces when that still gives every thread
// about two tiles; sorted largest first. Returns the tiles in exec.tiles.
void plan_row_tiles(CpuExec& exec, const int64_t* offset, int num_groups, int64_t max_rows);
// The same over ranges [begin[g], end[g]) of each group (a part of a layout).
void plan_row_tiles(CpuExec& exec, const int64_t* begin, const int64_t* end, int num_groups, int64_t max_rows);
// Tiles over the n output rows of each group's W_g for wgrad, split by the
// group's rows x n alone (not the thread count: on a many-core host a few small
// experts may give fewer tiles than threads); a group with no rows still gets one
// tile (its gradient is zero).
void plan_wgrad_tiles(CpuExec& exec, const int64_t* offset, int num_groups, int64_t n);

void grouped_gemm(CpuExec& exec, const GroupedGemmConfig& cfg, const GroupedGemmArgs& args);

void optimizer_step(ThreadPool& pool, const OptimizerConfig& cfg, const OptimizerArgs& args);
// One optimizer step in parts: prepare once (checks the config and args, folds
// the step's constants), then step any ranges of elements, in any order, on any
// threads; each element gets the bits optimizer_step gives it.
struct OptimizerPass {
  OptimizerKind kind;
  DType moments;
  float lr;
  AdamConstants adam;
};
OptimizerPass prepare_optimizer(const OptimizerConfig& cfg, const OptimizerArgs& args);
void optimizer_range(const OptimizerPass& pass, const OptimizerArgs& args, int64_t begin, int64_t end);

size_t expert_mlp_workspace_bytes(const ExpertMlpConfig& cfg, int num_threads, GemmEngine engine);
std::unique_ptr<PackedWeights> make_expert_weights(const ExpertMlpConfig& cfg, GemmEngine engine);
void pack_expert_weights(ThreadPool& pool, PackedWeights& packed, const float* w13, const float* w2, int first,
                         int count);
void update_expert_weights(ThreadPool& pool, const OptimizerConfig& cfg, const OptimizerArgs& w13,
                           const OptimizerArgs& w2, PackedWeights& packed, int num_experts);
void expert_mlp_forward(CpuExec& exec, const ExpertMlpConfig& cfg,
                        const ExpertMlpForwardArgs& args);
void expert_mlp_backward(CpuExec& exec, const ExpertMlpConfig& cfg,
                         const ExpertMlpBackwardArgs& args);

}  // namespace moe::kernels::cpu
