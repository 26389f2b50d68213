// oneDNN 2.6 matmul primitives (Debian libdnnl-dev, OpenMP runtime) behind
// onednn_matmul.h. 2.6 API: matmul::desc(a, b, c), then a primitive_desc.
#include "onednn_matmul.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <dnnl.hpp>
#include <vector>

#include "cpu_ops.h"
#include "moe/base/check.h"

namespace moe::kernels::cpu {
namespace {

using dnnl::memory;
using Dims = memory::dims;

thread_local int t_team = 0;  // this thread's OpenMP team as last set here; 0: never

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// One stream per thread: CPU streams are cheap, and no two threads share one.
dnnl::stream& thread_stream() {
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

void ensure_team_of_one() {
  if (t_team != 1) set_onednn_team(1);
}

memory::data_type dnnl_type(DType d) { return d == DType::kF32 ? memory::data_type::f32 : memory::data_type::bf16; }

memory::dim dim_or_runtime(int64_t d) { return d == kRuntimeDim ? DNNL_RUNTIME_DIM_VAL : d; }

std::string describe(const MatmulShape& s) {
  auto d = [](int64_t v) { return v == kRuntimeDim ? std::string("runtime") : std::to_string(v); };
  return std::string(dtype_name(s.dtype)) + " matmul m=" + d(s.m) + " k=" + d(s.k) + " n=" + d(s.n) +
         (s.trans_a ? " (A transposed)" : "") +
         (s.accumulate ? " (accumulating)" : "") + " -> " +
         dtype_name(s.out_dtype);
}

}  // namespace

struct OneDnnMatmul::Impl {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;

  memory::desc a_desc(const MatmulShape& s, memory::dim m, memory::dim k) const {
    return memory::desc({m, k}, dnnl_type(s.dtype), s.trans_a ? Dims{1, s.lda} : Dims{s.lda, 1});
  }
  memory::desc b_desc(const MatmulShape& s, memory::dim k) const {
    return memory::desc({k, s.n}, dnnl_type(s.dtype), Dims{s.ldb, 1});
  }
  memory::desc c_desc(const MatmulShape& s, memory::dim m) const {
    return memory::desc({m, s.n}, dnnl_type(s.out_dtype), Dims{s.ldc, 1});
  }
};

OneDnnMatmul::OneDnnMatmul(const MatmulShape& s) : shape_(s), impl_(std::make_unique<Impl>()) {
  MOE_CHECK(s.n > 0 && (s.k > 0 || s.k == kRuntimeDim) && (s.m > 0 || s.m == kRuntimeDim),
            "oneDNN ", describe(s), ": bad dimensions");
  ensure_team_of_one();
  const memory::dim m = dim_or_runtime(s.m), k = dim_or_runtime(s.k);
  const memory::desc b = impl_->b_desc(s, k);
  try {
    const dnnl::matmul::desc md(impl_->a_desc(s, m, k), b, impl_->c_desc(s, m));
    dnnl::primitive_attr attr;
    if (s.accumulate) {
      dnnl::post_ops ops;
      ops.append_sum(1.0f);
      attr.set_post_ops(ops);
    }
    impl_->pd = dnnl::matmul::primitive_desc(md, attr, cpu_engine());
    impl_->prim = dnnl::matmul(impl_->pd);
  } catch (const dnnl::error& e) {
    detail::fail("oneDNN has no ", describe(s), " on this CPU (ISA ", onednn_isa_name(), "): ", e.what());
  }
}

OneDnnMatmul::~OneDnnMatmul() = default;

void OneDnnMatmul::run(const void* a, const void* b, void* c, int64_t m, int64_t k) const {
  ensure_team_of_one();
  const MatmulShape& s = shape_;
  const memory::dim mm = s.m == kRuntimeDim ? m : s.m, kk = s.k == kRuntimeDim ? k : s.k;
  MOE_ASSERT(mm > 0 && kk > 0);
  memory ma(impl_->a_desc(s, mm, kk), cpu_engine(), const_cast<void*>(a));
  memory mb(impl_->b_desc(s, kk), cpu_engine(), const_cast<void*>(b));
  memory mc(impl_->c_desc(s, mm), cpu_engine(), c);
  impl_->prim.execute(thread_stream(), {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  thread_stream().wait();
}

std::string OneDnnMatmul::impl_name() const { return impl_->pd.impl_info_str(); }

void set_onednn_team(int threads) {
  omp_set_num_threads(threads);
  t_team = threads;
}

std::string onednn_isa_name() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_mic_4ops: return "avx512_mic_4ops";
    case dnnl::cpu_isa::avx512_mic: return "avx512_mic";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::sse41: return "sse41";
    default: return "none";
  }
}

bool onednn_has_bf16_dot() {
  const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
  return isa == dnnl::cpu_isa::avx512_core_bf16 || isa == dnnl::cpu_isa::avx512_core_amx;
}

// The probe builds what the backend builds: a weight gradient's matmul (A
// transposed, runtime m and k).
bool onednn_matmul_available(DType dtype) {
  auto probe = [](DType d) {
    try {
      OneDnnMatmul m({d, DType::kF32, kRuntimeDim, kRuntimeDim, 64, 64, 64, 64, true});
      return true;
    } catch (const Error&) {
      return false;
    }
  };
  static const bool available[2] = {probe(DType::kF32), probe(DType::kBF16)};
  return available[dtype == DType::kF32 ? 0 : 1];
}

double measure_onednn_gflops(DType dtype, int threads, int n, int repeats) {
  MOE_CHECK(threads >= 1 && n >= 1 && repeats >= 1, "measure_onednn_gflops: bad arguments");
  set_onednn_team(threads);
  double best = 0.0;
  try {
    const memory::desc d({n, n}, dnnl_type(dtype), memory::format_tag::ab);
    const memory::desc c({n, n}, memory::data_type::f32, memory::format_tag::ab);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(d, d, c), cpu_engine());
    const dnnl::matmul prim(pd);
    memory a(d, cpu_engine()), b(d, cpu_engine()), out(c, cpu_engine());
    const size_t elems = static_cast<size_t>(n) * n;
    // Small exact values: the operands' dtype does not change them.
    for (memory* mem : {&a, &b}) {
      if (dtype == DType::kF32) {
        float* p = static_cast<float*>(mem->get_data_handle());
        for (size_t i = 0; i < elems; ++i) p[i] = static_cast<float>((i * 7) % 13) * 0.125f;
      } else {
        bf16_t* p = static_cast<bf16_t*>(mem->get_data_handle());
        for (size_t i = 0; i < elems; ++i) p[i] = f32_to_bf16(static_cast<float>((i * 7) % 13) * 0.125f);
      }
    }
    dnnl::stream stream(cpu_engine());
    for (int r = 0; r < repeats + 1; ++r) {  // one more: the first call builds the kernels
      const auto t0 = std::chrono::steady_clock::now();
      prim.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, out}});
      stream.wait();
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) best = std::max(best, 2.0 * n * n * static_cast<double>(n) / sec / 1e9);
    }
  } catch (const dnnl::error& e) {
    set_onednn_team(1);
    detail::fail("oneDNN has no ", dtype_name(dtype), " ", n, "^3 matmul on this CPU (ISA ", onednn_isa_name(),
                 "): ", e.what());
  }
  set_onednn_team(1);
  return best;
}

}  // namespace moe::kernels::cpu
