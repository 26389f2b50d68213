// CpuBackend: the Backend operation table over the free functions of this folder.
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

#include "cpu_ops.h"
#include "moe/kernels/cpu_backend.h"
#include "moe/base/check.h"
#include "onednn_matmul.h"

namespace moe::kernels {

namespace cpu {

// Buffers of 2 MiB and more are 2 MiB aligned and asked to use transparent huge
// pages: permutes touch rows all over them, and 4 KiB pages cost a TLB miss per row.
void* host_alloc(size_t bytes) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t align = bytes >= kHuge ? kHuge : 64;
  const size_t size = (std::max<size_t>(bytes, 1) + align - 1) / align * align;
  void* p = std::aligned_alloc(align, size);
  MOE_CHECK(p != nullptr, "cpu backend: out of memory allocating ", bytes, " bytes");
  if (align == kHuge) ::madvise(p, size, MADV_HUGEPAGE);  // advisory; failure is harmless
  return p;
}

void host_free(void* p) { std::free(p); }

}  // namespace cpu

namespace {

class CpuBackend final : public Backend {
 public:
  CpuBackend(ThreadPool& pool, const CpuEngines& engines) : exec_(pool, engines) {
    MOE_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
              "the CPU backend needs AVX2 and FMA, which this processor lacks");
    cpu::init_blas_single_threaded();
    // oneDNN primitives are built on this thread: a team of one, as they run.
    cpu::set_onednn_team(1);
  }

  std::string name() const override { return "cpu"; }
  std::string gemm_engine() const override {
    return std::string("fp32=") + gemm_engine_name(exec_.engines.fp32) + " bf16=" + gemm_engine_name(exec_.engines.bf16);
  }
  std::string gemm_engine(DType d) const override { return gemm_engine_name(exec_.engines.of(d)); }
  ThreadPool& pool() { return exec_.pool; }
  int threads() const { return exec_.pool.num_threads(); }

  void* alloc(size_t bytes) override { return cpu::host_alloc(bytes); }
  void free(void* p) override { cpu::host_free(p); }
  void copy_to_device(void* dst, const void* src, size_t bytes) override { copy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, size_t bytes) override { copy(dst, src, bytes); }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void fill_zero(void* p, size_t bytes) override {
    if (bytes) std::memset(p, 0, bytes);
  }
  void synchronize() override {}

  void convert(const void* src, DType sd, void* dst, DType dd, int64_t count) override {
    cpu::convert(pool(), src, sd, dst, dd, count);
  }
  void add(void* dst, const void* src, DType dtype, int64_t count) override {
    cpu::add(pool(), dst, src, dtype, count);
  }
  void pack_rows(WireFormat f, const void* rows, DType dtype, int64_t n, int hidden, void* wire) override {
    cpu::pack_rows(pool(), f, rows, dtype, n, hidden, wire);
  }
  void unpack_rows(WireFormat f, const void* wire, int64_t n, int hidden, void* rows, DType dtype) override {
    cpu::unpack_rows(pool(), f, wire, n, hidden, rows, dtype);
  }

  std::unique_ptr<PackedWeights> make_router_weights(const RouterConfig& c) override {
    return cpu::make_router_weights(c, exec_.engines.of(c.x_dtype));
  }
  void pack_router_weights(PackedWeights& p, const float* weight) override {
    cpu::pack_router_weights(pool(), p, weight);
  }
  std::unique_ptr<PackedWeights> make_expert_weights(const ExpertMlpConfig& c) override {
    return cpu::make_expert_weights(c, exec_.engines.of(c.x_dtype));
  }
  void pack_expert_weights(PackedWeights& p, const float* w13, const float* w2, int first, int count) override {
    cpu::pack_expert_weights(pool(), p, w13, w2, first, count);
  }
  void update_expert_weights(const OptimizerConfig& c, const OptimizerArgs& w13, const OptimizerArgs& w2,
                             PackedWeights& p, int num_experts) override {
    cpu::update_expert_weights(pool(), c, w13, w2, p, num_experts);
  }

  size_t router_workspace_bytes(const RouterConfig& c) const override {
    return cpu::router_workspace_bytes(c, threads());
  }
  void router_forward(const RouterConfig& c, const RouterForwardArgs& a) override {
    cpu::router_forward(pool(), c, a);
  }
  void router_backward(const RouterConfig& c, const RouterBackwardArgs& a) override {
    cpu::router_backward(pool(), c, a);
  }

  size_t capacity_workspace_bytes(const CapacityConfig& c) const override {
    return cpu::capacity_workspace_bytes(c);
  }
  void capacity_drop(const CapacityConfig& c, const CapacityArgs& a) override {
    cpu::capacity_drop(pool(), c, a);
  }

  void select_replicas(int64_t T, int K, int E, const ReplicaArgs& a) override {
    cpu::parallel_blocks(pool(), T, 256, [&](int64_t t0, int64_t t1, int) {
      for (int64_t t = t0; t < t1; ++t)
        for (int k = 0; k < K; ++k) {
          const int32_t e = a.topk_idx[t * K + k];
          if (e < 0) {
            a.topk_slot[t * K + k] = -1;
            continue;
          }
          MOE_CHECK(e < E, "select_replicas: expert ", e, " out of range [0, ", E, ")");
          const int32_t count = a.logcnt[e];
          MOE_CHECK(count >= 1 && count <= a.max_replicas, "select_replicas: expert ", e, " has ", count, " replicas");
          a.topk_slot[t * K + k] =
              a.log2phy[static_cast<int64_t>(e) * a.max_replicas + replica_index(a.token_begin + t, e, count)];
        }
    });
  }

  size_t dispatch_layout_workspace_bytes(const DispatchLayoutConfig& c) const override {
    return cpu::dispatch_layout_workspace_bytes(c, threads());
  }
  void dispatch_layout(const DispatchLayoutConfig& c, const DispatchLayoutArgs& a) override {
    cpu::dispatch_layout(pool(), c, a);
  }

  size_t permute_layout_workspace_bytes(const PermuteLayoutConfig& c) const override {
    return cpu::permute_layout_workspace_bytes(c, threads());
  }
  void permute_layout(const PermuteLayoutConfig& c, const PermuteLayoutArgs& a) override {
    cpu::permute_layout(pool(), c, a);
  }
  void permute(const PermuteConfig& c, const PermuteArgs& a) override { cpu::permute(pool(), c, a); }
  void unpermute(const UnpermuteConfig& c, const UnpermuteArgs& a) override {
    cpu::unpermute(pool(), c, a);
  }
  void unpermute_scalars(const int32_t* pos, int64_t n, int k, const float* perm,
                         float* pair) override {
    for (int64_t i = 0; i < n * k; ++i) pair[i] = pos[i] >= 0 ? perm[pos[i]] : 0.0f;
  }
  void combine_pair_scalars(const int32_t* topk_slot, const int32_t* token_send_row, int64_t T, int K, int R,
                            int S, const float* rows, float* pair) override {
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) {
        const int32_t slot = topk_slot[t * K + k];
        pair[t * K + k] = slot < 0 ? 0.0f : rows[static_cast<int64_t>(token_send_row[t * R + slot / S]) * K + k];
      }
  }

  void swiglu_forward(const SwigluConfig& c, const SwigluForwardArgs& a) override {
    cpu::swiglu_forward(pool(), c, a);
  }
  void swiglu_backward(const SwigluConfig& c, const SwigluBackwardArgs& a) override {
    cpu::swiglu_backward(pool(), c, a);
  }

  void grouped_gemm(const GroupedGemmConfig& c, const GroupedGemmArgs& a) override {
    cpu::grouped_gemm(exec_, c, a);
  }

  void optimizer_step(const OptimizerConfig& c, const OptimizerArgs& a) override {
    cpu::optimizer_step(pool(), c, a);
  }

  size_t expert_mlp_workspace_bytes(const ExpertMlpConfig& c) const override {
    return cpu::expert_mlp_workspace_bytes(c, threads(), exec_.engines.of(c.x_dtype));
  }
  void expert_mlp_forward(const ExpertMlpConfig& c, const ExpertMlpForwardArgs& a) override {
    cpu::expert_mlp_forward(exec_, c, a);
  }
  void expert_mlp_backward(const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a) override {
    cpu::expert_mlp_backward(exec_, c, a);
  }

 private:
  cpu::CpuExec exec_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(ThreadPool& pool) {
  return std::make_unique<CpuBackend>(pool, cpu_backend_info().engines);
}

std::unique_ptr<Backend> make_cpu_backend(ThreadPool& pool, const CpuEngines& engines) {
  cpu::check_engines_run_here(engines, "make_cpu_backend");
  return std::make_unique<CpuBackend>(pool, engines);
}

}  // namespace moe::kernels
