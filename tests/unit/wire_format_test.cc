// The wire-format table (kernels/wire_format.h) against the spec: every v1::Wire
// value names a row, every row has its value, and the spec's checks refuse what
// the dispatcher's would (kernels::resolve_wire), for every value, dtype and role.
#include <gtest/gtest.h>

#include <string>

#include "moe/base/check.h"
#include "moe/kernels/wire_format.h"
#include "moe/layer_spec/job_layers.h"
#include "moe/spec/job_spec.h"

namespace moe::test {
namespace {

using kernels::WireFormat;

TEST(WireFormatTable, EverySpecValueNamesARowAndEveryRowHasAValue) {
  const auto* values = v1::Wire_descriptor();
  int named = 0;
  for (int i = 0; i < values->value_count(); ++i) {
    const auto w = static_cast<v1::Wire>(values->value(i)->number());
    const kernels::WireChoice f = layer_spec::wire(w);
    if (w == v1::WIRE_UNSPECIFIED) {
      EXPECT_FALSE(f) << "unset is the layer's own format";
      continue;
    }
    ASSERT_TRUE(f) << values->value(i)->name();
    EXPECT_EQ(std::string(kernels::wire_info(*f).name), values->value(i)->name());
    ++named;
  }
  EXPECT_EQ(named, static_cast<int>(std::size(kernels::kWireFormats)));
}

v1::JobSpec spec_with(v1::JobSpec::DType dtype, v1::Wire dispatch, v1::Wire combine) {
  v1::JobSpec s;
  s.set_experts(8);
  s.set_top_k(2);
  s.set_hidden(16);
  s.set_ffn_hidden(8);
  s.set_tokens_per_rank(16);
  s.set_steps(1);
  s.set_dtype(dtype);
  s.set_dispatch_wire(dispatch);
  s.set_combine_wire(combine);
  return spec::with_defaults(s);
}

bool resolves(kernels::WireChoice w, kernels::DType layer, kernels::WireRole role) {
  try {
    kernels::resolve_wire(w, layer, role);
    return true;
  } catch (const moe::Error&) {
    return false;
  }
}

bool valid(const v1::JobSpec& s) {
  try {
    spec::validate(s);
    return true;
  } catch (const moe::Error& e) {
    const std::string why = e.what();
    EXPECT_NE(why.find("_wire"), std::string::npos) << "the base spec is refused: " << why;
    return false;
  }
}

TEST(WireFormatTable, TheSpecRefusesWhatTheDispatcherWould) {
  const auto* values = v1::Wire_descriptor();
  for (v1::JobSpec::DType dt : {v1::JobSpec::fp32, v1::JobSpec::bf16}) {
    const kernels::DType layer = dt == v1::JobSpec::bf16 ? kernels::DType::kBF16 : kernels::DType::kF32;
    for (int i = 0; i < values->value_count(); ++i) {
      const auto w = static_cast<v1::Wire>(values->value(i)->number());
      SCOPED_TRACE(values->value(i)->name() + std::string(" on a ") + kernels::dtype_name(layer) + " layer");
      EXPECT_EQ(valid(spec_with(dt, w, v1::WIRE_UNSPECIFIED)),
                resolves(layer_spec::wire(w), layer, kernels::WireRole::kDispatch));
      EXPECT_EQ(valid(spec_with(dt, v1::WIRE_UNSPECIFIED, w)),
                resolves(layer_spec::wire(w), layer, kernels::WireRole::kCombine));
    }
  }
}

}  // namespace
}  // namespace moe::test
