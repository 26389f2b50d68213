#include "format.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <ctime>
#include <iomanip>
#include <sstream>

namespace moe::ctl {

std::string state_name(v1::JobState s) { return v1::JobState_Name(s).substr(10); }  // drop JOB_STATE_

std::string fmt(double v, int precision) {
  std::ostringstream os;
  os << std::setprecision(precision) << v;
  return os.str();
}

std::string human_bytes(double bytes) {
  static const char* units[] = {"B", "kB", "MB", "GB", "TB", "PB"};
  int u = 0;
  while (std::fabs(bytes) >= 1000 && u < 5) bytes /= 1000, ++u;
  return (u == 0 ? std::to_string(static_cast<int64_t>(bytes)) : fmt(bytes, 3)) + " " + units[u];
}

std::string human_count(double v) {
  if (!std::isfinite(v)) return "-";
  static const char* units[] = {"", "k", "M", "G", "T"};
  int u = 0;
  while (std::fabs(v) >= 999.5 && u < 4) v /= 1000, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u > 0 && v < 9.995 ? "%.2f%s" : u > 0 && v < 99.95 ? "%.1f%s" : "%.0f%s", v, units[u]);
  return buf;
}

std::string rate_text(double v) {
  if (!std::isfinite(v)) return "-";
  return std::fabs(v) >= 100 ? std::to_string(std::llround(v)) : fmt(v, 3);
}

std::string counted(int64_t n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

std::string human_seconds(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-";
  if (seconds < 10) return fmt(seconds, 2) + "s";
  const int64_t s = std::llround(seconds);
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(s));
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  else std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(s / 3600), static_cast<long long>(s / 60 % 60));
  return buf;
}

std::string local_time(double unix_ms) {
  if (unix_ms <= 0) return "-";
  const std::time_t t = static_cast<std::time_t>(unix_ms / 1000), now = std::time(nullptr);
  std::tm tm{}, today{};
  localtime_r(&t, &tm);
  localtime_r(&now, &today);
  char buf[32];
  const bool same_day = tm.tm_year == today.tm_year && tm.tm_yday == today.tm_yday;
  std::strftime(buf, sizeof buf, same_day ? "%H:%M:%S" : "%m-%d %H:%M", &tm);
  return buf;
}

int terminal_columns(int otherwise) {
  winsize ws{};
  if (isatty(STDOUT_FILENO) && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  if (const char* c = std::getenv("COLUMNS"); c && std::atoi(c) > 0) return std::atoi(c);
  return otherwise;
}

std::string ranks_text(int registered, int alive) {
  return counted(registered, "rank") + (alive < registered ? " (" + std::to_string(alive) + " alive)" : "");
}

std::string cut(const std::string& text, size_t width) {
  if (text.size() <= width) return text;
  return width <= 3 ? text.substr(0, width) : text.substr(0, width - 3) + "...";
}

std::string wrap(const std::string& text, int width, int indent) {
  std::string out, line;
  std::istringstream words(text);
  for (std::string w; words >> w;) {
    if (!line.empty() && static_cast<int>(line.size() + 1 + w.size()) > width) {
      out += line + "\n";
      line = std::string(indent, ' ');
    }
    line += (line.empty() || line.back() == ' ' ? "" : " ") + w;
  }
  return line.empty() ? out : out + line + "\n";
}

void print_rows(std::ostream& out, const std::vector<std::pair<std::string, std::string>>& rows) {
  size_t w = 0;
  for (const auto& [k, v] : rows) w = std::max(w, k.size());
  for (const auto& [k, v] : rows) out << std::left << std::setw(static_cast<int>(w) + 2) << k << v << "\n";
}

void print_table(std::ostream& out, const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> w;
  for (const auto& r : rows)
    for (size_t i = 0; i < r.size(); ++i) {
      if (w.size() <= i) w.push_back(0);
      w[i] = std::max(w[i], r[i].size());
    }
  for (const auto& r : rows) {
    std::ostringstream line;
    for (size_t i = 0; i < r.size(); ++i) line << std::left << std::setw(static_cast<int>(w[i]) + (i + 1 < r.size() ? 2 : 0)) << r[i];
    std::string s = line.str();
    s.erase(s.find_last_not_of(' ') + 1);  // no trailing blanks after an empty last cell
    out << s << "\n";
  }
}

}  // namespace moe::ctl
