// The CUDA backend's public face: device discovery (safe on machines without a GPU
// or driver: it then reports none) and the backend factory.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "moe/kernels/api.h"

namespace moe::kernels {

int cuda_device_count();

struct CudaDeviceInfo {
  int index = 0;
  std::string name;  // e.g. "NVIDIA H200"
  int sm_major = 0, sm_minor = 0;
  size_t memory_bytes = 0;
};
// Every visible device (empty without a GPU or driver).
std::vector<CudaDeviceInfo> cuda_devices();

// The CUDA backend on `device` (sm_90 kernels: throws moe::Error naming the device
// and its compute capability on anything else, or when there is no such device).
// Each op is ordered on the backend's own stream; its grouped GEMMs run as a loop
// of cublasGemmEx on streams or, for fp32 groups, as one cublasGemmGroupedBatchedEx
// call, per MOE_CUDA_GEMM ("loop", the default, or "grouped"). The backend makes its device
// current on every call, so one thread may drive backends on several devices.
std::unique_ptr<Backend> make_cuda_backend(int device);

}  // namespace moe::kernels
