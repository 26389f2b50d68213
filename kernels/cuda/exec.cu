// CudaExec: error checks, the device fault word, device selection.
#include <string>

#include "cuda_exec.h"
#include "moe/base/check.h"

namespace moe::kernels::cuda {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  throw Error(std::string("cuda backend: ") + what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

void check(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw Error(std::string("cuda backend: ") + what + ": " + cublasGetStatusName(s) + " (" + cublasGetStatusString(s) +
              ")");
}

std::string describe(const DeviceFault& f) {
  auto range = [&](int64_t lower) {
    return " is out of range [" + std::to_string(lower) + ", " + std::to_string(f.bound) + ")";
  };
  const std::string pos = std::to_string(f.position), val = std::to_string(f.value);
  switch (static_cast<FaultOp>(f.op)) {
    case FaultOp::kCapacityExpert:
      return "capacity: topk_idx[" + pos + "] = " + val + range(-1);
    case FaultOp::kReplicaExpert:
      return "select_replicas: topk_idx[" + pos + "] = " + val + range(-1);
    case FaultOp::kReplicaCount:
      return "select_replicas: expert " + pos + " has " + val + " replicas, outside [1, " + std::to_string(f.bound) + "]";
    case FaultOp::kDispatchSlot:
      return "dispatch layout: topk_slot[" + pos + "] = " + val + range(-1);
    case FaultOp::kPermuteLayoutExpert:
      return "permute layout: row_expert[" + pos + "] = " + val + range(-1);
    case FaultOp::kPermuteLayoutRowOrder:
      return "permute layout: row_order[" + pos + "] = " + val + range(0);
    case FaultOp::kPermuteSrcRow:
      return "permute: src_row[" + pos + "] = " + val + range(0);
    case FaultOp::kUnpermutePairPos:
      return "unpermute: pair_pos[" + pos + "] = " + val + range(-1);
    case FaultOp::kExpertSrcRow:
      return "expert mlp: perm_src_row[" + pos + "] = " + val + range(0);
    case FaultOp::kNone:
      break;
  }
  return "cuda backend: unknown device fault " + std::to_string(f.op);
}

void CudaExec::sync(const char* where) {
  // The fault word rides along with the sync: one small copy into pinned memory.
  check(cudaMemcpyAsync(fault_host, fault, sizeof(DeviceFault), cudaMemcpyDeviceToHost, stream), where);
  check(cudaStreamSynchronize(stream), where);
  if (fault_host->op == 0) return;
  const DeviceFault f = *fault_host;
  *fault_host = DeviceFault{};
  check(cudaMemsetAsync(fault, 0, sizeof(DeviceFault), stream), "clear fault");
  throw Error(describe(f));
}

void CudaExec::activate() const {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device) return;
  check(cudaSetDevice(device), "cudaSetDevice");
}

}  // namespace moe::kernels::cuda
