// The CPU backend and its measuring helpers.
#pragma once

#include <memory>

#include "moe/kernels/api.h"
#include "moe/kernels/thread_pool.h"

namespace moe::kernels {

// OpenBLAS single-threaded sgemm calls spread over `pool`; AVX2/FMA loops.
// The pool must outlive the backend. Throws on a CPU without AVX2/FMA.
std::unique_ptr<Backend> make_cpu_backend(ThreadPool& pool);

// GFLOP/s of the best of `repeats` n x n x n sgemm calls through OpenBLAS with its
// own `threads` threads (the same BLAS the backend uses). Leaves OpenBLAS
// single-threaded again on return.
double measure_sgemm_gflops(int threads, int n, int repeats);

}  // namespace moe::kernels
