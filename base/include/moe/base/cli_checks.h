// Number checks for the command lines of moectl, moed and moe-agent, with
// messages in plain numbers: "--timeout: must be a number > 0, got '0'" (CLI11's
// own checks print a double's limits in some 300 digits). Header-only: the mains
// that include it link CLI11.
#pragma once

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>

namespace moe {

// The text of a bound: 3600, 0.5, 1e+06.
inline std::string bound_text(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// A number (an integer if `integer`) of at least `lo` (more than `lo` if
// `above`) and at most `hi` (no upper bound when hi is infinite).
inline CLI::Validator number_check(double lo, double hi, bool integer, bool above = false) {
  const std::string kind = integer ? "an integer" : "a number";
  const std::string range = std::isinf(hi) ? (above ? "> " : ">= ") + bound_text(lo)
                            : above        ? "in (" + bound_text(lo) + ", " + bound_text(hi) + "]"
                                           : "in [" + bound_text(lo) + ", " + bound_text(hi) + "]";
  const std::string want = "must be " + kind + " " + range;
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double v = integer ? static_cast<double>(std::strtoll(text.c_str(), &end, 10)) : std::strtod(text.c_str(), &end);
        const bool parsed = !text.empty() && end && *end == '\0' && errno != ERANGE && std::isfinite(v);
        if (!parsed || v < lo || (above && v == lo) || v > hi) return want + ", got '" + text + "'";
        return "";
      },
      range);
}

inline CLI::Validator integer_in(double lo, double hi) { return number_check(lo, hi, true); }
inline CLI::Validator number_in(double lo, double hi) { return number_check(lo, hi, false); }
inline CLI::Validator integer_at_least(double lo) {
  return number_check(lo, std::numeric_limits<double>::infinity(), true);
}
inline CLI::Validator number_at_least(double lo) {
  return number_check(lo, std::numeric_limits<double>::infinity(), false);
}
inline CLI::Validator number_above(double lo) {
  return number_check(lo, std::numeric_limits<double>::infinity(), false, true);
}

}  // namespace moe
