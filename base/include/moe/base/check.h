// The error types and the MOE_CHECK macro family every layer shares.
//
// Host code throws moe::Error (or InvalidArgument, for bad input) with a message
// that names the bad value; the place that decides an error reports it; callers
// catch moe::Error. MOE_CHECK(cond, parts...) streams the parts
// into the message, e.g. MOE_CHECK(k <= e, "top_k (", k, ") exceeds experts (", e, ")").
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moe {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad input from a user or a peer (a spec field, a flag, a file, a request): the
// message names the field and the reason. The control plane answers it with
// INVALID_ARGUMENT (docs/control-plane.md#errors); moectl and the daemons exit 2.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw Error(os.str());
}
}  // namespace detail

}  // namespace moe

// Throws moe::Error built from the remaining arguments when cond is false.
#define MOE_CHECK(cond, ...)                      \
  do {                                            \
    if (!(cond)) ::moe::detail::fail(__VA_ARGS__); \
  } while (0)

// Internal invariant: a failure is a bug in moed, not bad input.
#define MOE_ASSERT(cond)                                                          \
  do {                                                                            \
    if (!(cond))                                                                  \
      ::moe::detail::fail(__FILE__, ":", __LINE__, ": internal check failed: ", #cond); \
  } while (0)
