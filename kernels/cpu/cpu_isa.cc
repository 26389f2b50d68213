#include "cpu_isa.h"

#include <cstdlib>
#include <cstring>

#include "moe/base/check.h"

namespace moe::kernels::cpu {

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx512Bf16: return "avx512-bf16";
    default: return "avx2";
  }
}

CpuIsa cpu_isa_best() {
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl"))
    return CpuIsa::kAvx2;
  return __builtin_cpu_supports("avx512bf16") ? CpuIsa::kAvx512Bf16 : CpuIsa::kAvx512;
}

CpuIsa cpu_isa_for(const char* requested, CpuIsa best) {
  if (!requested || !*requested) return best;
  for (const CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16})
    if (std::strcmp(requested, cpu_isa_name(isa)) == 0) {
      MOE_CHECK(isa <= best, "MOE_CPU_ISA='", requested, "': this CPU runs at most ", cpu_isa_name(best));
      return isa;
    }
  MOE_CHECK(false, "MOE_CPU_ISA='", requested, "': expected avx2, avx512 or avx512-bf16");
  return best;
}

CpuIsa cpu_isa() {
  static const CpuIsa isa = cpu_isa_for(std::getenv("MOE_CPU_ISA"), cpu_isa_best());
  return isa;
}

}  // namespace moe::kernels::cpu
