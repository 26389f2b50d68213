// The one exception type of the placement library and its check macro.
//
// Every invalid request (sizes that do not divide, zero ranks, a bad current
// map, a malformed loads file) throws PlacementError whose message names the
// bad value, e.g. "experts + redundant (257) must be divisible by ranks (32)".
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moe::placement {

class PlacementError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {
template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw PlacementError(os.str());
}
}  // namespace detail

}  // namespace moe::placement

// Throws PlacementError built from the remaining arguments when cond is false.
#define MOE_PLACEMENT_CHECK(cond, ...)                        \
  do {                                                        \
    if (!(cond)) ::moe::placement::detail::fail(__VA_ARGS__); \
  } while (0)
