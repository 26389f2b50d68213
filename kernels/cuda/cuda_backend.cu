// CudaBackend: the Backend operation table over the ops of this folder, the
// streams and handles they run on, stream-ordered pooled memory, packed weights.
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda_ops.h"
#include "moe/base/check.h"
#include "moe/kernels/cuda_device.h"

namespace moe::kernels {

namespace cuda {

CudaRouterWeights::~CudaRouterWeights() {
  if (gate) cudaFree(gate);
}
CudaExpertWeights::~CudaExpertWeights() {
  if (w13) cudaFree(w13);
  if (w2) cudaFree(w2);
}

std::unique_ptr<PackedWeights> make_router_weights(const RouterConfig& cfg) {
  auto p = std::make_unique<CudaRouterWeights>();
  p->cfg = cfg;
  if (cfg.x_dtype == DType::kBF16)
    check(cudaMalloc(&p->gate, 2 * static_cast<size_t>(cfg.num_experts) * cfg.hidden), "router packed weights");
  return p;
}

void pack_router_weights(CudaExec& ex, PackedWeights& packed, const float* weight) {
  auto* p = dynamic_cast<CudaRouterWeights*>(&packed);
  MOE_CHECK(p, "cuda router: packed weights not made by the CUDA backend");
  if (p->gate) convert(ex, weight, DType::kF32, p->gate, DType::kBF16, int64_t{p->cfg.num_experts} * p->cfg.hidden);
}

std::unique_ptr<PackedWeights> make_expert_weights(const ExpertMlpConfig& cfg) {
  auto p = std::make_unique<CudaExpertWeights>();
  p->cfg = cfg;
  if (cfg.x_dtype == DType::kBF16) {
    const size_t per = static_cast<size_t>(cfg.num_experts) * cfg.hidden * cfg.ffn_hidden;
    if (per) {
      check(cudaMalloc(&p->w13, 2 * 2 * per), "expert packed weights");
      check(cudaMalloc(&p->w2, 2 * per), "expert packed weights");
    }
  }
  return p;
}

void pack_expert_weights(CudaExec& ex, PackedWeights& packed, const float* w13, const float* w2, int first,
                         int count) {
  auto* p = dynamic_cast<CudaExpertWeights*>(&packed);
  MOE_CHECK(p, "cuda expert mlp: packed weights not made by the CUDA backend");
  MOE_CHECK(first >= 0 && count >= 0 && first + count <= p->cfg.num_experts, "cuda expert mlp: pack of experts [",
            first, ", ", first + count, ") outside [0, ", p->cfg.num_experts, ")");
  if (!p->w13 || count == 0) return;
  const int64_t n13 = int64_t{2} * p->cfg.ffn_hidden * p->cfg.hidden, n2 = int64_t{p->cfg.hidden} * p->cfg.ffn_hidden;
  convert(ex, w13 + first * n13, DType::kF32, p->w13 + first * n13, DType::kBF16, count * n13);
  convert(ex, w2 + first * n2, DType::kF32, p->w2 + first * n2, DType::kBF16, count * n2);
}

}  // namespace cuda

namespace {

bool grouped_gemm_requested() {
  const char* v = std::getenv("MOE_CUDA_GEMM");
  if (!v || !*v || std::strcmp(v, "loop") == 0) return false;
  if (std::strcmp(v, "grouped") == 0) return true;
  throw Error(std::string("MOE_CUDA_GEMM must be loop or grouped, got '") + v + "'");
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) {
    using cuda::check;
    const std::vector<CudaDeviceInfo> devices = cuda_devices();
    MOE_CHECK(device >= 0 && device < static_cast<int>(devices.size()), "cuda backend: no CUDA device ", device,
              " (", devices.size(), " visible)");
    const CudaDeviceInfo& d = devices[device];
    MOE_CHECK(d.sm_major == 9 && d.sm_minor == 0, "cuda backend: device ", device, " (", d.name,
              ") has compute capability ", d.sm_major, ".", d.sm_minor, "; this build has sm_90 kernels only");
    ex_.device = device;
    ex_.grouped_api = grouped_gemm_requested();
    check(cudaSetDevice(device), "cudaSetDevice");
    // Freed memory stays in the device's pool for the next allocation.
    cudaMemPool_t pool;
    check(cudaDeviceGetDefaultMemPool(&pool, device), "memory pool");
    uint64_t keep = UINT64_MAX;
    check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep), "memory pool");
    check(cudaStreamCreateWithFlags(&ex_.stream, cudaStreamNonBlocking), "stream");
    check(cublasCreate(&ex_.blas), "cublasCreate");
    check(cublasSetStream(ex_.blas, ex_.stream), "cublasSetStream");
    for (int s = 0; s < cuda::kGemmStreams; ++s) {
      check(cudaStreamCreateWithFlags(&ex_.side[s], cudaStreamNonBlocking), "stream");
      check(cublasCreate(&ex_.side_blas[s]), "cublasCreate");
      check(cublasSetStream(ex_.side_blas[s], ex_.side[s]), "cublasSetStream");
      check(cudaEventCreateWithFlags(&ex_.join[s], cudaEventDisableTiming), "event");
    }
    check(cudaEventCreateWithFlags(&ex_.fork, cudaEventDisableTiming), "event");
    check(cudaEventCreateWithFlags(&ex_.ptr_uploaded, cudaEventDisableTiming), "event");
    check(cudaMalloc(&ex_.fault, sizeof(cuda::DeviceFault)), "fault word");
    check(cudaMemset(ex_.fault, 0, sizeof(cuda::DeviceFault)), "fault word");
    check(cudaMallocHost(&ex_.fault_host, sizeof(cuda::DeviceFault)), "fault word");
    *ex_.fault_host = cuda::DeviceFault{};
  }

  ~CudaBackend() override {
    cudaSetDevice(ex_.device);
    cudaStreamSynchronize(ex_.stream);
    for (int s = 0; s < cuda::kGemmStreams; ++s) {
      cublasDestroy(ex_.side_blas[s]);
      cudaStreamDestroy(ex_.side[s]);
      cudaEventDestroy(ex_.join[s]);
    }
    cublasDestroy(ex_.blas);
    cudaEventDestroy(ex_.fork);
    cudaEventDestroy(ex_.ptr_uploaded);
    cudaFree(ex_.fault);
    cudaFreeHost(ex_.fault_host);
    if (ex_.ptr_host) cudaFreeHost(ex_.ptr_host);
    if (ex_.ptr_dev) cudaFree(ex_.ptr_dev);
    cudaStreamDestroy(ex_.stream);
  }

  std::string name() const override { return "cuda"; }
  std::string gemm_engine() const override {
    return "fp32=" + gemm_engine(DType::kF32) + " bf16=" + gemm_engine(DType::kBF16);
  }
  // bf16 groups run on the loop whatever MOE_CUDA_GEMM says (gemm.cu).
  std::string gemm_engine(DType d) const override {
    return ex_.grouped_api && d == DType::kF32 ? "cublas-grouped" : "cublas";
  }

  void* alloc(size_t bytes) override {
    ex().activate();
    void* p = nullptr;
    cuda::check(cudaMallocAsync(&p, std::max<size_t>(bytes, 1), ex_.stream), "cudaMallocAsync");
    return p;
  }
  void free(void* p) override {
    ex().activate();
    cudaFreeAsync(p, ex_.stream);
  }
  // Host memory may be pageable and reused by the caller at once: both host copies wait.
  void copy_to_device(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    cuda::check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ex().stream), "copy to device");
    ex_.sync("copy to device");
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    cuda::check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ex().stream), "copy to host");
    ex_.sync("copy to host");
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) cuda::check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ex().stream), "copy");
  }
  void fill_zero(void* p, size_t bytes) override {
    if (bytes) cuda::check(cudaMemsetAsync(p, 0, bytes, ex().stream), "fill_zero");
  }
  void synchronize() override { ex().sync("synchronize"); }

  void convert(const void* src, DType sd, void* dst, DType dd, int64_t n) override {
    cuda::convert(ex(), src, sd, dst, dd, n);
  }
  void pack_rows(WireFormat f, const void* rows, DType dtype, int64_t n, int hidden, void* wire) override {
    cuda::pack_rows(ex(), f, rows, dtype, n, hidden, wire);
  }
  void unpack_rows(WireFormat f, const void* wire, int64_t n, int hidden, void* rows, DType dtype) override {
    cuda::unpack_rows(ex(), f, wire, n, hidden, rows, dtype);
  }
  void add(void* dst, const void* src, DType dtype, int64_t n) override { cuda::add(ex(), dst, src, dtype, n); }

  std::unique_ptr<PackedWeights> make_router_weights(const RouterConfig& c) override {
    ex().activate();
    return cuda::make_router_weights(c);
  }
  void pack_router_weights(PackedWeights& p, const float* w) override { cuda::pack_router_weights(ex(), p, w); }
  std::unique_ptr<PackedWeights> make_expert_weights(const ExpertMlpConfig& c) override {
    ex().activate();
    return cuda::make_expert_weights(c);
  }
  void pack_expert_weights(PackedWeights& p, const float* w13, const float* w2, int first, int count) override {
    cuda::pack_expert_weights(ex(), p, w13, w2, first, count);
  }

  size_t router_workspace_bytes(const RouterConfig& c) const override { return cuda::router_workspace_bytes(c); }
  void router_forward(const RouterConfig& c, const RouterForwardArgs& a) override { cuda::router_forward(ex(), c, a); }
  void router_backward(const RouterConfig& c, const RouterBackwardArgs& a) override {
    cuda::router_backward(ex(), c, a);
  }

  size_t capacity_workspace_bytes(const CapacityConfig& c) const override { return cuda::capacity_workspace_bytes(c); }
  void capacity_drop(const CapacityConfig& c, const CapacityArgs& a) override { cuda::capacity_drop(ex(), c, a); }

  void select_replicas(int64_t T, int K, int E, const ReplicaArgs& a) override {
    cuda::select_replicas(ex(), T, K, E, a);
  }

  size_t dispatch_layout_workspace_bytes(const DispatchLayoutConfig& c) const override {
    return cuda::dispatch_layout_workspace_bytes(c);
  }
  void dispatch_layout(const DispatchLayoutConfig& c, const DispatchLayoutArgs& a) override {
    cuda::dispatch_layout(ex(), c, a);
  }
  size_t permute_layout_workspace_bytes(const PermuteLayoutConfig& c) const override {
    return cuda::permute_layout_workspace_bytes(c);
  }
  void permute_layout(const PermuteLayoutConfig& c, const PermuteLayoutArgs& a) override {
    cuda::permute_layout(ex(), c, a);
  }
  void permute(const PermuteConfig& c, const PermuteArgs& a) override { cuda::permute(ex(), c, a); }
  void unpermute(const UnpermuteConfig& c, const UnpermuteArgs& a) override { cuda::unpermute(ex(), c, a); }
  void unpermute_scalars(const int32_t* pos, int64_t n, int k, const float* perm, float* pair) override {
    cuda::unpermute_scalars(ex(), pos, n, k, perm, pair);
  }
  void combine_pair_scalars(const int32_t* topk_slot, const int32_t* token_send_row, int64_t T, int K, int R, int S,
                            const float* rows, float* pair) override {
    cuda::combine_pair_scalars(ex(), topk_slot, token_send_row, T, K, R, S, rows, pair);
  }

  void swiglu_forward(const SwigluConfig& c, const SwigluForwardArgs& a) override {
    c.validate();
    cuda::swiglu_forward(ex(), c.num_rows, c.ffn_hidden, a.gu, a.row_scale, a.h, DType::kF32);
  }
  void swiglu_backward(const SwigluConfig& c, const SwigluBackwardArgs& a) override {
    c.validate();
    cuda::swiglu_backward(ex(), c.num_rows, c.ffn_hidden, a.gu, a.grad_h, a.row_scale, a.grad_gu, a.grad_row_scale,
                          a.h, DType::kF32);
  }

  void grouped_gemm(const GroupedGemmConfig& c, const GroupedGemmArgs& a) override {
    cuda::grouped_gemm(ex(), c, a.group_offset, {a.a, CUDA_R_32F, a.b, CUDA_R_32F, a.c});
  }

  void optimizer_step(const OptimizerConfig& c, const OptimizerArgs& a) override { cuda::optimizer_step(ex(), c, a); }

  size_t expert_mlp_workspace_bytes(const ExpertMlpConfig& c) const override {
    return cuda::expert_mlp_workspace_bytes(c);
  }
  void expert_mlp_forward(const ExpertMlpConfig& c, const ExpertMlpForwardArgs& a) override {
    cuda::expert_mlp_forward(ex(), c, a);
  }
  void expert_mlp_backward(const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a) override {
    cuda::expert_mlp_backward(ex(), c, a);
  }

 private:
  // Every op runs with this backend's device current.
  cuda::CudaExec& ex() {
    ex_.activate();
    return ex_;
  }
  cuda::CudaExec ex_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device) { return std::make_unique<CudaBackend>(device); }

}  // namespace moe::kernels
