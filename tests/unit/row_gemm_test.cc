// The row-invariant GEMM (kernels/cpu/row_gemm.h, docs/backends.md#row-invariant-gemm)
// on every kernel this CPU runs: bit for bit the sequence of operations the
// header defines, computed here with std::fma one element at a time. Equal bits
// to a per-element definition is what makes a row's result independent of the
// rows beside it, of the call's size and of the kernel; the tests then also say
// so directly (a row alone, the AVX-512 kernel against the AVX2 one).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <string>

#include "cpu_isa.h"
#include "moe/base/check.h"
#include "moe/kernels/types.h"
#include "moe/model/synthetic.h"
#include "row_gemm.h"
#include "test_util.h"

namespace moe::test {
namespace {

using namespace moe::kernels;
using cpu::RowGemmB;
using cpu::RowGemmKernel;

std::vector<RowGemmKernel> kernels_here() {
  std::vector<RowGemmKernel> out = {RowGemmKernel::kAvx2};
  if (cpu::row_gemm_kernel(cpu::cpu_isa_best()) == RowGemmKernel::kAvx512) out.push_back(RowGemmKernel::kAvx512);
  return out;
}

// `size` zeroed bytes from a 64-byte boundary (panels and scratch).
struct Aligned {
  std::vector<uint8_t> raw;
  size_t size;
  explicit Aligned(size_t n) : raw(n + 64, 0), size(n) {}
  void* get() { return raw.data() + (64 - reinterpret_cast<uintptr_t>(raw.data()) % 64) % 64; }
  std::vector<uint8_t> bytes() {
    auto* p = static_cast<uint8_t*>(get());
    return std::vector<uint8_t>(p, p + size);
  }
};

// Scratch of a row GEMM call (any alignment; this one on a boundary).
struct Scratch {
  std::vector<uint8_t> bytes;
  explicit Scratch(int64_t n) : bytes(cpu::row_gemm_scratch_bytes(n) + 64) {}
  void* get() { return bytes.data() + (64 - reinterpret_cast<uintptr_t>(bytes.data()) % 64) % 64; }
};

// Values with small integer parts and many mantissa bits, so that the order of
// operations shows in the low bits; some exact zeros and negative zeros.
std::vector<float> values(int64_t n, uint64_t seed) {
  std::vector<float> v = normal_vector(n, seed);
  for (int64_t i = 0; i < n; i += 37) v[i] = (i / 37) % 2 ? 0.0f : -0.0f;
  return v;
}

// The definition: per element, each k block's fma chain from zero, then C plus
// the block's sum.
std::vector<float> defined(const std::vector<float>& a, int64_t m, int64_t k, const std::vector<float>& b_kn,
                           int64_t n) {
  std::vector<float> c(m * n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t k0 = 0; k0 < k; k0 += cpu::kRowGemmKc) {
        float p = 0.0f;
        for (int64_t v = k0; v < std::min(k, k0 + cpu::kRowGemmKc); ++v) p = std::fma(a[i * k + v], b_kn[v * n + j], p);
        acc = k0 == 0 ? p : acc + p;
      }
      c[i * n + j] = acc;
    }
  return c;
}

struct Case {
  int64_t m, k, n;
};

// How B reaches the call.
enum class BForm { kPanelsF32, kPanelsBf16, kWeightNk, kWeightKn, kWeightKnRounded };

std::string form_name(BForm f) {
  switch (f) {
    case BForm::kPanelsF32: return "panels fp32";
    case BForm::kPanelsBf16: return "panels bf16";
    case BForm::kWeightNk: return "weight [n,k]";
    case BForm::kWeightKn: return "weight [k,n]";
    default: return "weight [k,n] rounded to bf16";
  }
}

// C from the kernel with B in `form`, and B [k, n] as the kernel saw it.
std::vector<float> run(RowGemmKernel kernel, BForm form, const std::vector<float>& a, const Case& s, int64_t ldc,
                       std::vector<float>* b_used) {
  const std::vector<float> w = values(s.k * s.n, 100 + s.k + s.n);  // as [k, n]
  std::vector<float> w_nk(s.k * s.n);
  for (int64_t v = 0; v < s.k; ++v)
    for (int64_t j = 0; j < s.n; ++j) w_nk[j * s.k + v] = w[v * s.n + j];
  *b_used = w;
  const bool bf16 = form == BForm::kPanelsBf16 || form == BForm::kWeightKnRounded;
  if (bf16) model::round_to_bf16(*b_used);
  cpu::RowGemmPanels p{nullptr, bf16 ? DType::kBF16 : DType::kF32, kernel, s.k, s.n};
  Aligned panels(cpu::row_gemm_panel_elems(kernel, s.k, s.n) * dtype_size(p.dtype));
  RowGemmB b;
  if (form == BForm::kPanelsF32 || form == BForm::kPanelsBf16) {
    void* at = panels.get();
    // Alternate the two sources: panels of w^T [n, k] and of w [k, n] are the same.
    if ((s.k + s.n) % 2)
      cpu::pack_row_gemm_panels(kernel, w_nk.data(), true, s.k, s.n, p.dtype, at, 0, s.n);
    else
      cpu::pack_row_gemm_panels(kernel, w.data(), false, s.k, s.n, p.dtype, at, 0, s.k);
    p.data = at;
    b = RowGemmB::of(p);
  } else if (form == BForm::kWeightNk) {
    b = RowGemmB::weight(w_nk.data(), true, s.k, s.n, false);
  } else {
    b = RowGemmB::weight(w.data(), false, s.k, s.n, form == BForm::kWeightKnRounded);
  }
  std::vector<float> c(std::max<int64_t>(s.m, 1) * ldc, -7.0f);
  Scratch scratch(s.n);
  cpu::row_gemm(kernel, a.data(), s.m, s.k, b, c.data(), ldc, scratch.get());
  return c;
}

TEST(RowGemm, EveryKernelComputesTheDefinedSequenceBitForBit) {
  const Case cases[] = {{1, 1, 1},     {5, 7, 15},   {6, 255, 16},  {7, 256, 17},  {13, 257, 33},
                        {12, 600, 32}, {25, 64, 100}, {97, 513, 48}, {200, 300, 64}, {3, 0, 20}};
  for (const RowGemmKernel kernel : kernels_here())
    for (const BForm form : {BForm::kPanelsF32, BForm::kPanelsBf16, BForm::kWeightNk, BForm::kWeightKn,
                             BForm::kWeightKnRounded})
      for (const Case& s : cases) {
        const std::string what = std::string(cpu::row_gemm_kernel_name(kernel)) + " " + form_name(form) +
                                 " m=" + std::to_string(s.m) + " k=" + std::to_string(s.k) +
                                 " n=" + std::to_string(s.n);
        const std::vector<float> a = values(s.m * s.k, 7 + s.m);
        const int64_t ldc = s.n + 5;
        std::vector<float> b;
        const std::vector<float> c = run(kernel, form, a, s, ldc, &b);
        const std::vector<float> want = defined(a, s.m, s.k, b, s.n);
        for (int64_t i = 0; i < s.m; ++i) {
          for (int64_t j = 0; j < s.n; ++j)
            ASSERT_EQ(std::bit_cast<uint32_t>(c[i * ldc + j]), std::bit_cast<uint32_t>(want[i * s.n + j]))
                << what << " at (" << i << ", " << j << "): " << c[i * ldc + j] << " vs " << want[i * s.n + j];
          for (int64_t j = s.n; j < ldc; ++j) ASSERT_EQ(c[i * ldc + j], -7.0f) << what << ": padding written";
        }
      }
}

// The property the definition gives, said directly: any rows, alone or in any
// call, on either kernel, give the bits of the whole call on the AVX2 kernel.
TEST(RowGemm, ARowsBitsDoNotDependOnTheCallOrTheKernel) {
  const int64_t m = 130, k = 1024, n = 96;
  const std::vector<float> a = values(m * k, 3), w = values(n * k, 4);  // w [n, k]
  const RowGemmB b = RowGemmB::weight(w.data(), true, k, n, false);
  Scratch scratch(n);
  std::vector<float> whole(m * n);
  cpu::row_gemm(RowGemmKernel::kAvx2, a.data(), m, k, b, whole.data(), n, scratch.get());
  for (const RowGemmKernel kernel : kernels_here())
    for (const auto& [begin, rows] : std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {5, 1}, {7, 3}, {31, 50},
                                                                             {96, 34}, {0, 130}, {129, 1}}) {
      std::vector<float> part(rows * n);
      cpu::row_gemm(kernel, a.data() + begin * k, rows, k, b, part.data(), n, scratch.get());
      for (int64_t i = 0; i < rows * n; ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(part[i]), std::bit_cast<uint32_t>(whole[begin * n + i]))
            << cpu::row_gemm_kernel_name(kernel) << " rows [" << begin << ", " << begin + rows << ") element " << i;
    }
}

// The sequence is accurate: within k 2^-24 of the sum of |terms| of the exact
// product (a sanity bound on the definition itself).
TEST(RowGemm, MatchesDoubleWithinTheFmaChainsBound) {
  const int64_t m = 9, k = 1500, n = 40;
  const std::vector<float> a = values(m * k, 21), w = values(k * n, 22);
  Scratch scratch(n);
  std::vector<float> c(m * n);
  cpu::row_gemm(a.data(), m, k, RowGemmB::weight(w.data(), false, k, n, false), c.data(), n, scratch.get());
  std::vector<double> got, want, bound;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, abs_s = 0;
      for (int64_t v = 0; v < k; ++v) {
        s += static_cast<double>(a[i * k + v]) * w[v * n + j];
        abs_s += std::fabs(static_cast<double>(a[i * k + v]) * w[v * n + j]);
      }
      got.push_back(c[i * n + j]);
      want.push_back(s);
      bound.push_back(abs_s * static_cast<double>(k));
    }
  EXPECT_TRUE(close_bounded("row gemm", got, want, bound, 0x1.0p-24, 0, 0));
}

// Panels packed in ranges (as threads and the optimizer's fused update pack
// them) are the bytes of one whole pack; a column range must start on a panel.
TEST(RowGemm, PanelsPackedInRangesEqualOneWholePack) {
  for (const RowGemmKernel kernel : kernels_here())
    for (const DType d : {DType::kF32, DType::kBF16})
      for (const bool w_nk : {true, false}) {
        const int64_t k = 70, n = 3 * cpu::row_gemm_nr(kernel) + 5, rows = w_nk ? n : k;
        const std::vector<float> w = values(k * n, 9);
        const size_t bytes = cpu::row_gemm_panel_elems(kernel, k, n) * dtype_size(d);
        Aligned whole(bytes), parts(bytes);
        cpu::pack_row_gemm_panels(kernel, w.data(), w_nk, k, n, d, whole.get(), 0, rows);
        const int64_t step = w_nk ? cpu::row_gemm_nr(kernel) : 9;
        for (int64_t r = 0; r < rows; r += step)
          cpu::pack_row_gemm_panels(kernel, w.data(), w_nk, k, n, d, parts.get(), r, std::min(rows, r + step));
        EXPECT_EQ(parts.bytes(), whole.bytes())
            << cpu::row_gemm_kernel_name(kernel) << " " << dtype_name(d) << " w_nk " << w_nk;
      }
  std::vector<float> w(16 * 16);
  Aligned out(16 * 64 * 4);
  EXPECT_THROW(cpu::pack_row_gemm_panels(RowGemmKernel::kAvx2, w.data(), true, 16, 16, DType::kF32, out.get(), 3, 16),
               Error);
}

TEST(RowGemm, RefusesPanelsOfAnotherKernelOrShape) {
  const std::vector<float> w(64 * 8, 1.0f), a(8, 1.0f);
  std::vector<float> panels(cpu::row_gemm_panel_elems(RowGemmKernel::kAvx512, 8, 64)), c(64);
  Scratch scratch(64);
  const cpu::RowGemmPanels p{panels.data(), DType::kF32, RowGemmKernel::kAvx512, 8, 64};
  try {
    cpu::row_gemm(RowGemmKernel::kAvx2, a.data(), 1, 8, RowGemmB::of(p), c.data(), 64, scratch.get());
    FAIL() << "panels of the avx512 kernel ran on the avx2 one";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("packed for the avx512 kernel"), std::string::npos) << e.what();
  }
  RowGemmB wrong = RowGemmB::of(p);
  wrong.n = 32;
  EXPECT_THROW(cpu::row_gemm(RowGemmKernel::kAvx512, a.data(), 1, 8, wrong, c.data(), 64, scratch.get()), Error);
}

TEST(CpuIsa, MoeCpuIsaCapsTheKernelsAndNamesBadValues) {
  using cpu::CpuIsa;
  EXPECT_EQ(cpu::cpu_isa_for(nullptr, CpuIsa::kAvx512Bf16), CpuIsa::kAvx512Bf16);
  EXPECT_EQ(cpu::cpu_isa_for("", CpuIsa::kAvx512), CpuIsa::kAvx512);
  EXPECT_EQ(cpu::cpu_isa_for("avx512", CpuIsa::kAvx512Bf16), CpuIsa::kAvx512);
  EXPECT_EQ(cpu::cpu_isa_for("avx2", CpuIsa::kAvx512Bf16), CpuIsa::kAvx2);
  EXPECT_EQ(cpu::row_gemm_kernel(CpuIsa::kAvx2), RowGemmKernel::kAvx2);
  EXPECT_EQ(cpu::row_gemm_kernel(CpuIsa::kAvx512Bf16), RowGemmKernel::kAvx512);
  for (const char* bad : {"avx512-bf16", "sse4", "AVX2"}) {
    try {
      cpu::cpu_isa_for(bad, CpuIsa::kAvx512);
      FAIL() << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("MOE_CPU_ISA"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace moe::test
