// Which instruction set the CPU backend's kernel families run (docs/backends.md#isa).
// Each family with more than one kernel (the row-invariant GEMM, the few-row
// GEMMs) picks the best the process's ISA allows; MOE_CPU_ISA caps it, so a
// machine with AVX-512 runs, and tests, the AVX2 code too.
#pragma once

namespace moe::kernels::cpu {

// Narrowest first. AVX-512 needs F, BW and VL; kAvx512Bf16 adds AVX512_BF16.
enum class CpuIsa { kAvx2, kAvx512, kAvx512Bf16 };

const char* cpu_isa_name(CpuIsa isa);  // avx2 | avx512 | avx512-bf16
// The best this CPU runs.
CpuIsa cpu_isa_best();
// The ISA this process runs: cpu_isa_best() capped by MOE_CPU_ISA, read once.
CpuIsa cpu_isa();
// The ISA a MOE_CPU_ISA value asks for on a CPU whose best is `best` (null or
// empty: best); a name that is not an ISA, or one the CPU cannot run, throws
// naming the variable and the choices.
CpuIsa cpu_isa_for(const char* requested, CpuIsa best);
// Whether this CPU runs code of `isa` (tests run every kernel it can).
inline bool cpu_isa_runs_here(CpuIsa isa) { return isa <= cpu_isa_best(); }

}  // namespace moe::kernels::cpu
