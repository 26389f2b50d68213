#include "format.h"

#include <iomanip>
#include <sstream>

namespace moe::ctl {

std::string state_name(v1::JobState s) { return v1::JobState_Name(s).substr(10); }  // drop JOB_STATE_

std::string fmt(double v, int precision) {
  std::ostringstream os;
  os << std::setprecision(precision) << v;
  return os.str();
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
    for (size_t i = 0; i < r.size(); ++i) out << std::left << std::setw(static_cast<int>(w[i]) + (i + 1 < r.size() ? 2 : 0)) << r[i];
    out << "\n";
  }
}

}  // namespace moe::ctl
