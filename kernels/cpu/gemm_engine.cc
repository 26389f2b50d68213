// Which GEMM engine the CPU backend runs per storage dtype: the table, the
// MOE_GEMM_ENGINE override, and the peak measurements behind both.
#include <cstdlib>
#include <fstream>
#include <string_view>

#include "cpu_ops.h"
#include "moe/base/check.h"
#include "moe/kernels/cpu_backend.h"
#include "onednn_matmul.h"
#include "row_gemm.h"

extern "C" char* openblas_get_corename();

namespace moe::kernels {
namespace {

// The engine table, keyed by oneDNN's effective ISA (the CPU's features read at
// run time; ONEDNN_MAX_CPU_ISA caps them). Filled from same-run measurements of
// `moe-bench layer` (docs/benchmarks.md#single-rank-layer); never from a timing at start-up, so
// every rank of a job on one kind of machine picks the same engine.
struct EngineRow {
  std::string_view isa;
  CpuEngines engines;
};
constexpr GemmEngine kBlas = GemmEngine::kOpenBlas, kDnn = GemmEngine::kOneDnn;
constexpr EngineRow kEngineTable[] = {
    // bf16 dot products: oneDNN's bf16 matmul. Its fp32 matmul measured faster
    // than OpenBLAS 0.3.21 there too (which runs its Haswell kernels on Zen 5);
    // AMX follows the avx512_core_bf16 row (not measured).
    {"avx512_core_amx", {kDnn, kDnn}},
    {"avx512_core_bf16", {kDnn, kDnn}},
    // AVX-512 without bf16 dot products: oneDNN emulates them, slower than
    // converting to fp32 for OpenBLAS; fp32 measured the same on both: OpenBLAS stays.
    {"avx512_core_vnni", {kBlas, kBlas}},
    {"avx512_core", {kBlas, kBlas}},
    // AVX2 and below (every other ISA): oneDNN 2.6 has no bf16 matmul; its fp32
    // matmul measured slower than OpenBLAS.
};

std::string trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  return std::string(s);
}

std::string read_cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return trim(std::string_view(line).substr(colon + 1));
    }
  return "unknown";
}

// "openblas" | "onednn" | "auto" (nullopt-like: returns false for auto).
bool parse_engine(std::string_view name, std::string_view whole, GemmEngine& out) {
  if (name == "openblas") {
    out = GemmEngine::kOpenBlas;
    return true;
  }
  if (name == "onednn") {
    out = GemmEngine::kOneDnn;
    return true;
  }
  if (name == "auto") return false;
  detail::fail("MOE_GEMM_ENGINE='", whole, "': unknown engine '", name,
               "' (expected openblas, onednn, auto, or per dtype like bf16=onednn,fp32=openblas)");
}

// Applies MOE_GEMM_ENGINE's value to the table's engines.
CpuEngines apply_override(std::string_view value, CpuEngines engines) {
  if (value.find('=') == std::string_view::npos) {
    GemmEngine e;
    if (parse_engine(trim(value), value, e)) engines = {e, e};
    return engines;
  }
  size_t pos = 0;
  while (pos <= value.size()) {
    const size_t comma = std::min(value.find(',', pos), value.size());
    const std::string item = trim(value.substr(pos, comma - pos));
    const size_t eq = item.find('=');
    MOE_CHECK(eq != std::string::npos, "MOE_GEMM_ENGINE='", value, "': '", item,
              "' is not dtype=engine (e.g. bf16=onednn)");
    const std::string dtype_text = trim(std::string_view(item).substr(0, eq));
    MOE_CHECK(dtype_text == "fp32" || dtype_text == "bf16", "MOE_GEMM_ENGINE='", value, "': unknown dtype '",
              dtype_text, "' (expected fp32 or bf16)");
    const DType dtype = parse_dtype(dtype_text);
    GemmEngine e;
    if (parse_engine(trim(std::string_view(item).substr(eq + 1)), value, e))
      (dtype == DType::kF32 ? engines.fp32 : engines.bf16) = e;
    pos = comma + 1;
  }
  return engines;
}

}  // namespace

const char* gemm_engine_name(GemmEngine e) { return e == GemmEngine::kOpenBlas ? "openblas" : "onednn"; }

CpuEngines engine_table(const std::string& isa) {
  for (const EngineRow& row : kEngineTable)
    if (row.isa == isa) return row.engines;
  return {kBlas, kBlas};
}

bool onednn_supports(DType dtype) { return cpu::onednn_matmul_available(dtype); }

void cpu::check_engines_run_here(const CpuEngines& engines, const std::string& source) {
  for (DType d : {DType::kF32, DType::kBF16})
    MOE_CHECK(engines.of(d) != GemmEngine::kOneDnn || onednn_supports(d), source, ": oneDNN has no ", dtype_name(d),
              " matmul on this CPU (ISA ", onednn_isa_name(), ")");
}

CpuBackendInfo cpu_backend_info() {
  CpuBackendInfo info;
  info.cpu_model = read_cpu_model();
  info.isa = cpu::onednn_isa_name();
  info.bf16_dot = cpu::onednn_has_bf16_dot();
  info.engines = engine_table(info.isa);
  info.engine_source = "table";
  const char* env = std::getenv("MOE_GEMM_ENGINE");
  if (env && *env) {
    info.engine_source = std::string("MOE_GEMM_ENGINE=") + env;
    info.engines = apply_override(env, info.engines);
  }
  cpu::check_engines_run_here(info.engines, info.engine_source);
  const cpu::CpuIsa isa = cpu::cpu_isa();
  info.cpu_isa = cpu::cpu_isa_name(isa);
  const char* cap = std::getenv("MOE_CPU_ISA");
  info.cpu_isa_source = cap && *cap ? std::string("MOE_CPU_ISA=") + cap : "cpu";
  info.row_gemm = cpu::row_gemm_kernel_name(cpu::row_gemm_kernel(isa));
  info.openblas_core = openblas_get_corename();
  return info;
}

double measure_gemm_gflops(GemmEngine engine, DType dtype, int threads, int n, int repeats) {
  if (engine == GemmEngine::kOpenBlas) return measure_sgemm_gflops(threads, n, repeats);
  return cpu::measure_onednn_gflops(dtype, threads, n, repeats);
}

std::string cpu_backend_summary() {
  try {
    const CpuBackendInfo i = cpu_backend_info();
    return "cpu backend on " + i.cpu_model + ": ISA " + i.cpu_isa + " (" + i.cpu_isa_source + "); row-invariant GEMM " +
           i.row_gemm + " (expert forward and dgrad, router logits); weight gradients fp32=" + i.gemm_engine(DType::kF32) +
           " bf16=" + i.gemm_engine(DType::kBF16) + " (" + i.engine_source + "; OpenBLAS core " + i.openblas_core +
           ", oneDNN ISA " + i.isa + ")";
  } catch (const std::exception& e) {
    return std::string("cpu backend: ") + e.what();
  }
}

}  // namespace moe::kernels
