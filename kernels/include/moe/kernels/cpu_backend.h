// The CPU backend, its GEMM engines and its measuring helpers.
//
// The GEMMs a row goes through (the experts' forward and dgrad, the router's
// logits) run on the backend's own row-invariant GEMM on every engine
// (docs/backends.md#row-invariant-gemm). The engine runs the rest: the weight
// gradients (the experts' and the router's) and the router's dx.
// GEMM engines (the table is in kernels/cpu/gemm_engine.cc and docs/backends.md):
//   openblas: OpenBLAS sgemm on fp32 panels; bf16 storage is converted to fp32 first.
//   onednn:   oneDNN matmul in the storage dtype: bf16 operands with bf16 dot
//             products (avx512_bf16, AMX) and fp32 accumulation; fp32 stays fp32.
// The engine per dtype comes from a table keyed by the CPU's features as oneDNN
// reads them at run time (ONEDNN_MAX_CPU_ISA caps them), never from a timing, so
// every rank of a job on the same kind of machine computes the same numbers.
// MOE_GEMM_ENGINE overrides it: "openblas", "onednn", "auto" (the table), or per
// dtype, e.g. "bf16=onednn,fp32=openblas".
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "moe/kernels/api.h"
#include "moe/kernels/thread_pool.h"

namespace moe::kernels {

enum class GemmEngine : uint8_t { kOpenBlas, kOneDnn };
const char* gemm_engine_name(GemmEngine e);  // "openblas" | "onednn"

struct CpuEngines {
  GemmEngine fp32 = GemmEngine::kOpenBlas;
  GemmEngine bf16 = GemmEngine::kOpenBlas;
  GemmEngine of(DType d) const { return d == DType::kF32 ? fp32 : bf16; }
};

// What the CPU backend runs on this machine (for logs, metrics and benchmarks).
struct CpuBackendInfo {
  std::string cpu_model;  // /proc/cpuinfo "model name", or "unknown"
  // The ISA the backend's own kernel families run (avx2 | avx512 | avx512-bf16):
  // the CPU's best, or less where MOE_CPU_ISA caps it (cpu_isa_source says which).
  std::string cpu_isa, cpu_isa_source;
  std::string row_gemm;   // the row-invariant GEMM's kernel: avx2 | avx512
  std::string isa;        // oneDNN's effective ISA, e.g. "avx512_core_bf16" (ONEDNN_MAX_CPU_ISA caps it)
  std::string openblas_core;  // OpenBLAS's kernel set, e.g. "Zen" (OPENBLAS_CORETYPE picks it)
  bool bf16_dot = false;  // the ISA has bf16 dot products (avx512_bf16 or AMX)
  CpuEngines engines;     // the table's choice, or MOE_GEMM_ENGINE's
  std::string engine_source;  // "table" or "MOE_GEMM_ENGINE=<value>"
  const char* gemm_engine(DType d) const { return gemm_engine_name(engines.of(d)); }
};

// Reads the CPU's features and MOE_GEMM_ENGINE now. Throws moe::Error naming a bad
// MOE_GEMM_ENGINE value, or an engine this CPU cannot run (oneDNN bf16 needs AVX-512).
CpuBackendInfo cpu_backend_info();

// One line for --version and logs: every kernel family's ISA and engine (see
// cpu_backend_summary in gemm_engine.cc), or the reason the backend cannot run.
std::string cpu_backend_summary();

// The table alone: the engines for a CPU whose oneDNN ISA is `isa` (a name as in
// CpuBackendInfo::isa).
CpuEngines engine_table(const std::string& isa);

// OpenBLAS single-threaded sgemm calls or oneDNN single-threaded matmuls spread
// over `pool`; AVX2/FMA loops. The pool must outlive the backend. Throws on a CPU
// without AVX2/FMA. The first form takes the engines from cpu_backend_info(); the
// second as given (throws if this CPU cannot run them).
std::unique_ptr<Backend> make_cpu_backend(ThreadPool& pool);
std::unique_ptr<Backend> make_cpu_backend(ThreadPool& pool, const CpuEngines& engines);

// True when oneDNN can run a matmul of `dtype` on this CPU (bf16 needs AVX-512;
// without bf16 dot products oneDNN emulates them).
bool onednn_supports(DType dtype);

// GFLOP/s of the best of `repeats` n x n x n sgemm calls through OpenBLAS with its
// own `threads` threads (the same BLAS the backend uses). Leaves OpenBLAS
// single-threaded again on return.
double measure_sgemm_gflops(int threads, int n, int repeats);

// GFLOP/s of the best of `repeats` n x n x n GEMMs as `engine` runs `dtype` with
// `threads` threads: openblas is measure_sgemm_gflops (bf16 computes in fp32
// there); onednn is one matmul primitive in dtype (fp32 accumulation) on an
// OpenMP team of `threads`. Leaves the calling thread's team at one on return.
double measure_gemm_gflops(GemmEngine engine, DType dtype, int threads, int n, int repeats);

}  // namespace moe::kernels
