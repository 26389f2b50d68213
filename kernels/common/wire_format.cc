#include "moe/kernels/wire_format.h"

#include "moe/base/check.h"

namespace moe::kernels {

std::optional<WireFormat> wire_by_name(std::string_view name) {
  for (const WireFormatInfo& f : kWireFormats)
    if (name == f.name) return f.format;
  return std::nullopt;
}

const WireFormatInfo& resolve_wire(WireChoice choice, DType layer, WireRole role) {
  const WireFormatInfo& f = wire_info(choice.value_or(wire_of(layer)));
  const char* which = role == WireRole::kDispatch ? "dispatch" : "combine";
  MOE_CHECK(role == WireRole::kDispatch || f.plain, "combine wire ", f.name,
            ": results go back as plain values (fp32 or bf16)");
  MOE_CHECK(!f.plain || dtype_size(f.dtype) <= dtype_size(layer), which, " wire ", f.name, " is wider than the layer's ",
            dtype_name(layer), " rows");
  return f;
}

}  // namespace moe::kernels
