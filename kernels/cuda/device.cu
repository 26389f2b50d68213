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

}  // namespace moe::kernels
