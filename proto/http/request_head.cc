#include "moe/http/request_head.h"

#include <algorithm>

namespace moe::http {
namespace {

bool is_token(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= 'A' && c <= 'Z'; });
}

bool is_target(std::string_view s) {
  return !s.empty() && s.front() == '/' &&
         std::all_of(s.begin(), s.end(), [](char c) { return c > ' ' && c < 0x7f; });
}

}  // namespace

Answer answer_for(std::string_view head) {
  const Answer bad{400, "Bad Request"};
  const size_t eol = head.find("\r\n");
  if (eol == std::string_view::npos) return bad;
  const std::string_view line = head.substr(0, eol);
  const size_t sp1 = line.find(' ');
  if (sp1 == std::string_view::npos) return bad;
  const size_t sp2 = line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos) return bad;
  const std::string_view method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1),
                         version = line.substr(sp2 + 1);
  if (!is_token(method) || !is_target(target) || (version != "HTTP/1.1" && version != "HTTP/1.0")) return bad;
  const std::string_view path = target.substr(0, target.find('?'));
  if (path != "/metrics" && path != "/healthz") return {404, "Not Found", ""};
  if (method != "GET" && method != "HEAD") return {405, "Method Not Allowed", ""};
  return {200, "OK", std::string(path)};
}

}  // namespace moe::http
