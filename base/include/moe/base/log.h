// Process logging for the three processes: one line per event on stderr,
//   2026-11-30T12:00:00.123Z moed[node1] INFO registered as node 1 (ranks 2-3)
// with an ISO-8601 UTC timestamp, the role and an identity (rank, node name).
#pragma once

#include <sstream>
#include <string>

namespace moe::log {

enum class Level { kDebug, kInfo, kWarn, kError };

// Sets the role and identity printed on every line (call once at start-up).
void init(const std::string& role, const std::string& identity);
void set_identity(const std::string& identity);
void write(Level level, const std::string& message);

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

template <typename... Parts>
void info(const Parts&... parts) { write(Level::kInfo, concat(parts...)); }
template <typename... Parts>
void warn(const Parts&... parts) { write(Level::kWarn, concat(parts...)); }
template <typename... Parts>
void error(const Parts&... parts) { write(Level::kError, concat(parts...)); }

}  // namespace moe::log
