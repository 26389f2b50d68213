// A flat-or-nested list of named figures that prints as an aligned table or as
// JSON. Benchmarks build one and print it; insertion order is kept.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <variant>
#include <vector>

namespace moe::bench {

// The median of v (the upper one of an even count; 0 when empty).
double median(std::vector<double> v);

class Report {
 public:
  Report& add(const std::string& key, double v);
  Report& add(const std::string& key, int64_t v);
  Report& add(const std::string& key, const std::string& v);
  Report& add(const std::string& key, const char* v) { return add(key, std::string(v)); }
  Report& add(const std::string& key, bool v);
  // A nested section; returns it for filling.
  Report& section(const std::string& key);

  void print_json(std::ostream& os) const;
  void print_table(std::ostream& os, const std::string& indent = "") const;

 private:
  using Value = std::variant<double, int64_t, std::string, bool, std::shared_ptr<Report>>;
  void write_json(std::ostream& os) const;
  std::vector<std::pair<std::string, Value>> items_;
};

}  // namespace moe::bench
