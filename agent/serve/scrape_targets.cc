#include "moe/agent/scrape_targets.h"

#include <sstream>

namespace moe::agent {
namespace {

// Names and addresses are plain text; escape what JSON needs anyway.
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out + "\"";
}

}  // namespace

std::string file_sd_json(const std::vector<ScrapeTarget>& targets) {
  std::ostringstream os;
  os << "[";
  bool first = true;
  for (const ScrapeTarget& t : targets) {
    if (t.address.empty()) continue;
    os << (first ? "\n" : ",\n") << "  {\"targets\": [" << quoted(t.address) << "], \"labels\": {\"role\": "
       << quoted(t.role) << ", \"node\": " << quoted(t.node) << "}}";
    first = false;
  }
  os << "\n]\n";
  return os.str();
}

}  // namespace moe::agent
