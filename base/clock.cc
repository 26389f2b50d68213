#include "moe/base/clock.h"

#include <chrono>
#include <ctime>

namespace moe {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double unix_ms() {
  return static_cast<double>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

namespace {

std::string utc_format(double ms, const char* format) {
  const std::time_t t = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  const size_t n = std::strftime(buf, sizeof buf, format, &tm);
  return std::string(buf, n);
}

}  // namespace

std::string utc_time_of_day(double ms) { return utc_format(ms, "%H:%M:%S UTC"); }
std::string utc_date_time(double ms) { return utc_format(ms, "%Y-%m-%d %H:%M:%S UTC"); }

}  // namespace moe
