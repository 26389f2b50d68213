// Grouped GEMMs over variable groups on cuBLAS, bf16 or fp32 operands, fp32
// accumulation (CUBLAS_COMPUTE_32F: no TF32 shortcut for fp32, so fp32 layers
// match the fp64 reference as tightly as the CPU backend does).
//
// Row-major operands map onto column-major cuBLAS by transposing the product:
//   kForward  C[M, n] = A W^T      ->  C^T = W A^T     (op T, op N)
//   kDgrad    C[M, k] = A W        ->  C^T = W^T A^T   (op N, op N)
//   kWgrad    W[n, k] = A^T D      ->  W^T = D^T A     (op N, op T)
// Two ways to run the groups (MOE_CUDA_GEMM picks; see README "CUDA backend"):
//   loop:    one cublasGemmEx per non-empty group, round-robin over kGemmStreams
//            streams forked from and joined back into the rank's stream;
//   grouped: one cublasGemmGroupedBatchedEx call (per-group sizes in host
//            arrays, pointer arrays uploaded from pinned memory). cuBLAS has it
//            for fp32 -> fp32 and bf16 -> bf16 only, not bf16 operands with an
//            fp32 output: groups with bf16 operands run on the loop.
#include <algorithm>
#include <vector>

#include "cuda_ops.h"
#include "moe/base/check.h"

namespace moe::kernels::cuda {
namespace {

size_t type_size(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : 2; }

// One group's cuBLAS call: column-major m x n x k with leading dimensions.
struct GemmCall {
  cublasOperation_t ta, tb;
  int m, n, k, lda, ldb, ldc;
  const void* a;
  const void* b;
  float* c;
};

// The call of group g, rows [r0, r0 + rows), per the table above.
GemmCall call_for(const GroupedGemmConfig& cfg, int g, int64_t r0, int rows, const GemmOperands& op) {
  const int64_t n = cfg.n, k = cfg.k;
  const auto* a = static_cast<const uint8_t*>(op.a);
  const auto* b = static_cast<const uint8_t*>(op.b);
  const size_t sa = type_size(op.a_type), sb = type_size(op.b_type);
  const int in = static_cast<int>(n), ik = static_cast<int>(k);
  switch (cfg.kind) {
    case GemmKind::kForward:
      return {CUBLAS_OP_T, CUBLAS_OP_N, in, rows, ik, ik, ik, in, b + g * n * k * sb, a + r0 * k * sa, op.c + r0 * n};
    case GemmKind::kDgrad:
      return {CUBLAS_OP_N, CUBLAS_OP_N, ik, rows, in, ik, in, ik, b + g * n * k * sb, a + r0 * n * sa, op.c + r0 * k};
    case GemmKind::kWgrad:
      break;
  }
  return {CUBLAS_OP_N, CUBLAS_OP_T, ik, in, rows, ik, in, ik, b + r0 * k * sb, a + r0 * n * sa, op.c + g * n * k};
}

// The first operand of the call is W (forward, dgrad) or D (wgrad), both op.b.
void run_one(cublasHandle_t h, const GemmCall& c, const GemmOperands& op, float beta) {
  const float one = 1.0f;
  check(cublasGemmEx(h, c.ta, c.tb, c.m, c.n, c.k, &one, c.a, op.b_type, c.lda, c.b, op.a_type, c.ldb, &beta, c.c,
                     CUDA_R_32F, c.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "grouped GEMM (cublasGemmEx)");
}

void run_loop(CudaExec& ex, const std::vector<GemmCall>& calls, const GemmOperands& op, float beta) {
  if (calls.size() == 1) return run_one(ex.blas, calls[0], op, beta);
  const int streams = static_cast<int>(std::min<size_t>(calls.size(), kGemmStreams));
  check(cudaEventRecord(ex.fork, ex.stream), "gemm fork");
  for (int s = 0; s < streams; ++s) check(cudaStreamWaitEvent(ex.side[s], ex.fork, 0), "gemm fork");
  for (size_t i = 0; i < calls.size(); ++i) run_one(ex.side_blas[i % streams], calls[i], op, beta);
  for (int s = 0; s < streams; ++s) {
    check(cudaEventRecord(ex.join[s], ex.side[s]), "gemm join");
    check(cudaStreamWaitEvent(ex.stream, ex.join[s], 0), "gemm join");
  }
}

// Grows the pinned and device pointer arrays to hold `count` pointers.
void reserve_pointers(CudaExec& ex, size_t count) {
  if (ex.ptr_uploaded) check(cudaEventSynchronize(ex.ptr_uploaded), "gemm pointer upload");
  if (count <= ex.ptr_capacity) return;
  // The last grouped GEMM may still read ptr_dev: let it finish before the free.
  check(cudaStreamSynchronize(ex.stream), "gemm pointer arrays");
  const size_t cap = std::max<size_t>(count, 2 * ex.ptr_capacity);
  if (ex.ptr_host) cudaFreeHost(ex.ptr_host);
  if (ex.ptr_dev) cudaFree(ex.ptr_dev);
  ex.ptr_host = nullptr;
  ex.ptr_dev = nullptr;
  ex.ptr_capacity = 0;
  check(cudaMallocHost(&ex.ptr_host, cap * sizeof(void*)), "gemm pointer arrays");
  check(cudaMalloc(&ex.ptr_dev, cap * sizeof(void*)), "gemm pointer arrays");
  ex.ptr_capacity = cap;
}

void run_grouped(CudaExec& ex, const std::vector<GemmCall>& calls, const GemmOperands& op, float beta) {
  const size_t G = calls.size();
  std::vector<cublasOperation_t> ta(G), tb(G);
  std::vector<int> m(G), n(G), k(G), lda(G), ldb(G), ldc(G), size(G, 1);
  std::vector<float> alpha(G, 1.0f), betas(G, beta);
  reserve_pointers(ex, 3 * G);
  for (size_t i = 0; i < G; ++i) {
    const GemmCall& c = calls[i];
    ta[i] = c.ta;
    tb[i] = c.tb;
    m[i] = c.m;
    n[i] = c.n;
    k[i] = c.k;
    lda[i] = c.lda;
    ldb[i] = c.ldb;
    ldc[i] = c.ldc;
    ex.ptr_host[i] = const_cast<void*>(c.a);
    ex.ptr_host[G + i] = const_cast<void*>(c.b);
    ex.ptr_host[2 * G + i] = c.c;
  }
  check(cudaMemcpyAsync(ex.ptr_dev, ex.ptr_host, 3 * G * sizeof(void*), cudaMemcpyHostToDevice, ex.stream),
        "gemm pointer upload");
  check(cudaEventRecord(ex.ptr_uploaded, ex.stream), "gemm pointer upload");
  check(cublasGemmGroupedBatchedEx(ex.blas, ta.data(), tb.data(), m.data(), n.data(), k.data(), alpha.data(),
                                   ex.ptr_dev, op.b_type, lda.data(), ex.ptr_dev + G, op.a_type, ldb.data(),
                                   betas.data(), ex.ptr_dev + 2 * G, CUDA_R_32F, ldc.data(), static_cast<int>(G),
                                   size.data(), CUBLAS_COMPUTE_32F),
        "grouped GEMM (cublasGemmGroupedBatchedEx)");
}

}  // namespace

void grouped_gemm(CudaExec& ex, const GroupedGemmConfig& cfg, const int64_t* off, const GemmOperands& op) {
  grouped_gemm(ex, cfg, off, off + 1, op);
}

void grouped_gemm(CudaExec& ex, const GroupedGemmConfig& cfg, const int64_t* row_begin, const int64_t* row_end,
                  const GemmOperands& op) {
  cfg.validate();
  std::vector<GemmCall> calls;
  const size_t w_bytes = 4 * static_cast<size_t>(cfg.n) * cfg.k;
  for (int g = 0; g < cfg.num_groups; ++g) {
    const int64_t rows = row_end[g] - row_begin[g];
    MOE_CHECK(row_begin[g] >= 0, "grouped gemm: group ", g, " starts at row ", row_begin[g]);
    MOE_CHECK(rows >= 0 && rows < (int64_t{1} << 31), "grouped gemm: group ", g, " has ", rows, " rows");
    if (rows > 0 && cfg.n > 0 && cfg.k > 0) {
      calls.push_back(call_for(cfg, g, row_begin[g], static_cast<int>(rows), op));
    } else if (cfg.kind == GemmKind::kWgrad && !cfg.accumulate) {  // an empty group's gradient is zero
      check(cudaMemsetAsync(op.c + g * cfg.n * cfg.k, 0, w_bytes, ex.stream), "grouped gemm");
    }
  }
  if (calls.empty()) return;
  const float beta = cfg.accumulate ? 1.0f : 0.0f;
  const bool grouped_types = op.a_type == CUDA_R_32F && op.b_type == CUDA_R_32F;  // see the header comment
  if (ex.grouped_api && grouped_types && calls.size() > 1)
    run_grouped(ex, calls, op, beta);
  else
    run_loop(ex, calls, op, beta);
}

}  // namespace moe::kernels::cuda
