// Device discovery: never throws, reports no devices where there is no GPU or driver.
#include <cuda_runtime.h>

#include "moe/kernels/cuda_device.h"

namespace moe::kernels {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

std::vector<CudaDeviceInfo> cuda_devices() {
  std::vector<CudaDeviceInfo> out;
  const int n = cuda_device_count();
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    out.push_back({i, p.name, p.major, p.minor, p.totalGlobalMem});
  }
  return out;
}

}  // namespace moe::kernels
