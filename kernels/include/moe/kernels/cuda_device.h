// Device discovery for the CUDA backend. Safe to call on machines without a GPU
// or driver: it then reports 0 devices.
#pragma once

namespace moe::kernels {

int cuda_device_count();

}  // namespace moe::kernels
