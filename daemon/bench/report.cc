#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>

namespace moe::bench {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
namespace {

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

}  // namespace

Report& Report::add(const std::string& key, double v) {
  items_.emplace_back(key, v);
  return *this;
}
Report& Report::add(const std::string& key, int64_t v) {
  items_.emplace_back(key, v);
  return *this;
}
Report& Report::add(const std::string& key, const std::string& v) {
  items_.emplace_back(key, v);
  return *this;
}
Report& Report::add(const std::string& key, bool v) {
  items_.emplace_back(key, v);
  return *this;
}
Report& Report::section(const std::string& key) {
  auto r = std::make_shared<Report>();
  items_.emplace_back(key, r);
  return *r;
}

void Report::write_json(std::ostream& os) const {
  os << "{";
  for (size_t i = 0; i < items_.size(); ++i) {
    os << (i ? ", " : "") << quote(items_[i].first) << ": ";
    const Value& v = items_[i].second;
    if (auto d = std::get_if<double>(&v)) os << number(*d);
    else if (auto n = std::get_if<int64_t>(&v)) os << *n;
    else if (auto s = std::get_if<std::string>(&v)) os << quote(*s);
    else if (auto b = std::get_if<bool>(&v)) os << (*b ? "true" : "false");
    else std::get<std::shared_ptr<Report>>(v)->write_json(os);
  }
  os << "}";
}

void Report::print_json(std::ostream& os) const {
  write_json(os);
  os << "\n";
}

void Report::print_table(std::ostream& os, const std::string& indent) const {
  size_t width = 0;
  for (const auto& [k, v] : items_) width = std::max(width, k.size());
  for (const auto& [k, v] : items_) {
    if (auto r = std::get_if<std::shared_ptr<Report>>(&v)) {
      os << indent << k << ":\n";
      (*r)->print_table(os, indent + "  ");
      continue;
    }
    os << indent << std::left << std::setw(static_cast<int>(width) + 2) << k;
    if (auto d = std::get_if<double>(&v)) os << number(*d);
    else if (auto n = std::get_if<int64_t>(&v)) os << *n;
    else if (auto s = std::get_if<std::string>(&v)) os << *s;
    else if (auto b = std::get_if<bool>(&v)) os << (*b ? "true" : "false");
    os << "\n";
  }
}

}  // namespace moe::bench
