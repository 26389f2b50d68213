// What every CUDA op runs with (the rank's stream, the GEMM streams and their
// cuBLAS handles, the device fault word), the error checks, and the launch helpers
// the kernels share (dtype dispatch, grid sizes; bf16 storage is row_logic.cuh's).
// Internal to kernels/cuda: included by .cu files only.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "moe/kernels/api.h"
#include "row_logic.cuh"

namespace moe::kernels::cuda {

// Throws moe::Error "<what>: <CUDA/cuBLAS error string>" unless the call succeeded.
void check(cudaError_t e, const char* what);
void check(cublasStatus_t s, const char* what);

// A bad value a kernel found (an index out of range). Kernels cannot throw: the
// first fault is kept in device memory and thrown, naming the op, the position and
// the value, at the op's next host sync (layout ops, synchronize()).
enum class FaultOp : int32_t {
  kNone = 0,
  kCapacityExpert,
  kReplicaExpert,
  kReplicaCount,
  kDispatchSlot,
  kPermuteLayoutExpert,
  kPermuteLayoutRowOrder,
  kPermuteSrcRow,
  kUnpermutePairPos,
  kExpertSrcRow,
};
struct DeviceFault {
  int32_t op;  // FaultOp
  int32_t pad;
  int64_t position;
  int64_t value;
  int64_t bound;  // the valid range is [lower, bound)
};
// Describes a fault as the CPU backend's checks would ("permute layout: row_expert
// pair 12 = 9 is out of range [-1, 8)").
std::string describe(const DeviceFault& f);

__device__ inline void report_fault(DeviceFault* f, FaultOp op, int64_t position, int64_t value, int64_t bound) {
  if (atomicCAS(&f->op, 0, static_cast<int32_t>(op)) == 0) {
    f->position = position;
    f->value = value;
    f->bound = bound;
  }
}

// Streams over which a grouped GEMM spreads its groups; each has its own cuBLAS
// handle (a handle's workspace must not be shared by concurrent streams).
constexpr int kGemmStreams = 4;

struct CudaExec {
  int device = 0;
  cudaStream_t stream = nullptr;  // the rank's stream: every op is ordered on it
  cublasHandle_t blas = nullptr;  // bound to `stream`
  cudaStream_t side[kGemmStreams] = {};
  cublasHandle_t side_blas[kGemmStreams] = {};
  cudaEvent_t fork = nullptr, join[kGemmStreams] = {};
  DeviceFault* fault = nullptr;     // device
  DeviceFault* fault_host = nullptr;  // pinned mirror
  bool grouped_api = false;  // fp32 GEMM groups through cublasGemmGroupedBatchedEx (else a loop on streams)
  // The grouped API's per-group pointer arrays: pinned host staging, their device
  // copy (capacity in pointers), and the event of the last upload.
  void** ptr_host = nullptr;
  void** ptr_dev = nullptr;
  size_t ptr_capacity = 0;
  cudaEvent_t ptr_uploaded = nullptr;

  // Waits for the stream, then throws the first kernel fault (and clears it).
  void sync(const char* where);
  // Makes `device` current on the calling thread (each rank thread owns one GPU).
  void activate() const;
};

// ---------------------------------------------------------------------------
// Launch helpers (bf16s and its conversions: row_logic.cuh).

// Calls f(float{}) or f(bf16s{}) for the storage type of d.
template <typename F>
inline void with_dtype(DType d, F&& f) {
  if (d == DType::kF32)
    f(float{});
  else
    f(bf16s{});
}

constexpr int kThreads = 256;
inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

inline cudaDataType_t cuda_type(DType d) { return d == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF; }

}  // namespace moe::kernels::cuda
