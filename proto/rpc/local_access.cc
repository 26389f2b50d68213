#include "moe/rpc/local_access.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace moe::rpc {
namespace fs = std::filesystem;

namespace {

std::string read_trimmed(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  const auto b = s.find_first_not_of(" \t\r\n");
  const auto e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

}  // namespace

std::string default_state_dir() {
  if (const char* dir = std::getenv("MOE_STATE_DIR"); dir && *dir) return dir;
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.local/state/moed";
}

LocalAccess local_access(const std::string& state_dir, const std::string& cert_name) {
  const fs::path dir = state_dir;
  LocalAccess a;
  if (fs::exists(dir / "agent_address")) a.agent = read_trimmed(dir / "agent_address");
  if (fs::exists(dir / "token")) a.token = read_token_file((dir / "token").string());
  if (const fs::path tls = dir / "tls"; fs::exists(tls / "ca.pem"))
    a.tls = {(tls / (cert_name + ".pem")).string(), (tls / (cert_name + ".key")).string(), (tls / "ca.pem").string()};
  return a;
}

}  // namespace moe::rpc
