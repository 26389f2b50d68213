// The EP data plane's wire formats (docs/layer.md#wire-formats), in one table:
// how a row of `hidden` values travels between ranks. Everything that picks,
// sizes, packs or emulates a format reads it here. The spec's `v1::Wire` values
// join it by `name` (layer_spec::wire); the Dispatcher sizes and packs rows with
// it (resolve_wire, row_bytes, Backend::pack_rows / unpack_rows, one exhaustive
// switch per backend); the fp64 reference emulates each (ref::through_wire).
// A new format: its row here, its case in each backend's pack and unpack and in
// the reference, its proto value, and its line in docs/layer.md.
// C++17: the CUDA sources include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "moe/kernels/types.h"

namespace moe::kernels {

enum class WireFormat : uint8_t { kF32, kBF16, kFP8 };

struct WireFormatInfo {
  WireFormat format;
  const char* name;  // the JobSpec's v1::Wire value name
  bool plain;        // rows of plain `dtype` values: packing is a conversion (permute fuses it)
  DType dtype;       // plain formats: the values' dtype
  int value_bytes;   // per value
  int scale_bytes;   // per group of scale_group values (0: no scales)
  int scale_group;
  constexpr int64_t scales(int hidden) const {
    return scale_bytes == 0 ? 0 : (hidden + scale_group - 1) / scale_group;
  }
  constexpr size_t row_bytes(int hidden) const {
    return static_cast<size_t>(value_bytes) * hidden + static_cast<size_t>(scale_bytes) * scales(hidden);
  }
};

inline constexpr WireFormatInfo kWireFormats[] = {
    {WireFormat::kF32, "fp32", true, DType::kF32, 4, 0, 0},
    {WireFormat::kBF16, "bf16", true, DType::kBF16, 2, 0, 0},
    // types.h#fp8: e4m3 values, then one fp32 scale per 128 values (DeepEP's dispatch format).
    {WireFormat::kFP8, "fp8", false, DType::kF32, 1, 4, kFp8GroupSize},
};

constexpr const WireFormatInfo& wire_info(WireFormat f) { return kWireFormats[static_cast<int>(f)]; }
constexpr bool wire_table_in_order() {
  for (size_t i = 0; i < sizeof(kWireFormats) / sizeof(kWireFormats[0]); ++i)
    if (static_cast<size_t>(kWireFormats[i].format) != i) return false;
  return true;
}
static_assert(wire_table_in_order(), "kWireFormats: row i must be format i");

// A job's choice of format: nullopt is the layer's own.
using WireChoice = std::optional<WireFormat>;

// The format of the layer's own rows.
constexpr WireFormat wire_of(DType layer) { return layer == DType::kBF16 ? WireFormat::kBF16 : WireFormat::kF32; }
// The table's row named `name` ("fp32", "bf16", "fp8"); nullopt: none.
std::optional<WireFormat> wire_by_name(std::string_view name);

enum class WireRole { kDispatch, kCombine };
// The format a layer of dtype `layer` sends its rows in for `role`, given the
// job's choice (nullopt: the layer's own). Throws moe::Error for a format wider
// than the layer's rows, or a packed one for the combine (results are summed on
// arrival: they travel as plain values).
const WireFormatInfo& resolve_wire(WireChoice choice, DType layer, WireRole role);

}  // namespace moe::kernels
