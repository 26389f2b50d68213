#include "moe/base/log.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace moe::log {
namespace {
std::mutex mu;
std::string role = "moe", identity;
const char* level_name(Level l) {
  switch (l) {
    case Level::kDebug: return "DEBUG";
    case Level::kInfo: return "INFO";
    case Level::kWarn: return "WARN";
    case Level::kError: return "ERROR";
  }
  return "?";
}
}  // namespace

void init(const std::string& r, const std::string& id) {
  std::lock_guard<std::mutex> lock(mu);
  role = r;
  identity = id;
}

void set_identity(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu);
  identity = id;
}

void write(Level level, const std::string& message) {
  const auto now = std::chrono::system_clock::now();
  const std::time_t secs = std::chrono::system_clock::to_time_t(now);
  const int ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  ::gmtime_r(&secs, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &tm);
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "%s.%03dZ %s[%s] %s %s\n", stamp, ms, role.c_str(), identity.c_str(), level_name(level),
               message.c_str());
  std::fflush(stderr);
}

}  // namespace moe::log
