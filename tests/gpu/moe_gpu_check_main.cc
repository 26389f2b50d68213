// moe-gpu-check: the device check of docs/device-check.md. Runs every CUDA check (gpu_checks.h)
// on device 0, one line each, then "N passed, N failed"; with --bench, the GPU
// benchmarks as JSON lines (and into --out DIR). Exit 0 when every check passed,
// 1 when one failed, 2 without a device or on bad arguments.
//
//   moe-gpu-check [--bench] [--no-checks] [--out DIR] [--iters N] [--tokens T]
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <iostream>
#include <string>

#include "gpu_bench.h"
#include "gpu_checks.h"
#include "moe/base/clock.h"
#include "moe/kernels/cuda_device.h"

namespace {

struct Options {
  bool checks = true, bench = false;
  std::string out_dir;
  moe::gpucheck::BenchShape shape;
};

bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    if (a == "--bench") {
      o.bench = true;
    } else if (a == "--no-checks") {
      o.checks = false;
    } else if (a == "--out") {
      const char* v = value();
      if (!v) return false;
      o.out_dir = v;
    } else if (a == "--iters" || a == "--tokens") {
      const char* v = value();
      if (!v || std::atoll(v) <= 0) return false;
      if (a == "--iters")
        o.shape.iters = std::atoi(v);
      else
        o.shape.tokens = std::atoll(v);
    } else {
      return false;
    }
  }
  return true;
}

// Runs one check on a fresh backend per GEMM mode; prints PASS/FAIL lines.
int run_checks(std::ostream& log) {
  int passed = 0, failed = 0;
  auto run_all = [&](const std::vector<moe::gpucheck::Check>& checks, const char* prefix) {
    auto be = moe::kernels::make_cuda_backend(0);
    for (const moe::gpucheck::Check& c : checks) {
      const double t0 = moe::now_seconds();
      moe::gpucheck::Result r;
      try {
        r = c.run(*be);
      } catch (const std::exception& e) {
        r = {false, std::string("threw: ") + e.what()};
      }
      (r.passed ? passed : failed)++;
      log << (r.passed ? "PASS " : "FAIL ") << prefix << c.name << " (" << moe::now_seconds() - t0 << " s)"
          << (r.detail.empty() ? "" : ": " + r.detail) << std::endl;
    }
  };
  run_all(moe::gpucheck::all_checks(), "");
  ::setenv("MOE_CUDA_GEMM", "grouped", 1);  // the GEMM-dependent checks again, grouped
  run_all(moe::gpucheck::gemm_checks(), "grouped/");
  ::unsetenv("MOE_CUDA_GEMM");
  log << passed << " passed, " << failed << " failed" << std::endl;
  return failed == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) {
    std::cerr << "usage: moe-gpu-check [--bench] [--no-checks] [--out DIR] [--iters N] [--tokens T]\n";
    return 2;
  }
  const auto devices = moe::kernels::cuda_devices();
  if (devices.empty()) {
    std::cerr << "moe-gpu-check: no CUDA device visible\n";
    return 2;
  }
  for (const auto& d : devices)
    std::cout << "device " << d.index << ": " << d.name << " (sm_" << d.sm_major << d.sm_minor << ", "
              << d.memory_bytes / (1 << 20) << " MiB)" << std::endl;
  int rc = 0;
  try {
    if (o.checks) rc = run_checks(std::cout);
    if (o.bench) {
      std::ofstream json;
      if (!o.out_dir.empty()) json.open(o.out_dir + "/gpu_bench.jsonl");
      for (const std::string& line : moe::gpucheck::run_benches(o.shape)) {
        std::cout << line << std::endl;
        if (json) json << line << "\n";
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "moe-gpu-check: " << e.what() << std::endl;
    return 1;
  }
  return rc;
}
