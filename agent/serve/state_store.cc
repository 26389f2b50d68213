#include "moe/agent/state_store.h"

#include <boost/crc.hpp>

#include <algorithm>
#include <cstdint>
#include <system_error>

#include "moe/base/file.h"

namespace moe::agent {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kMagic = "moe-agent-state 1\n";
constexpr size_t kHeaderBytes = kMagic.size() + 8 + 4;

uint32_t crc32(const std::string& bytes) {
  boost::crc_32_type crc;
  crc.process_bytes(bytes.data(), bytes.size());
  return crc.checksum();
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t get_le(const std::string& in, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(in[at + i])) << (8 * i);
  return v;
}

}  // namespace

StateStore::StateStore(const fs::path& dir) : file_(dir / "agent_state.pb") {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw StateFileError("state dir " + dir.string() + ": cannot create it" + (ec ? ": " + ec.message() : ""));
}

std::string StateStore::encode(const v1::AgentState& state) {
  const std::string body = state.SerializeAsString();
  std::string out(kMagic);
  put_le(out, body.size(), 8);
  put_le(out, crc32(body), 4);
  return out + body;
}

v1::AgentState StateStore::decode(const std::string& bytes, const std::string& file) {
  auto refuse = [&](const std::string& why) { return StateFileError("agent state file " + file + ": " + why); };
  const size_t common = std::min(bytes.size(), kMagic.size());
  if (bytes.compare(0, common, kMagic.substr(0, common)) != 0)
    throw refuse("not an agent state file (no 'moe-agent-state 1' header)");
  if (bytes.size() < kHeaderBytes)
    throw refuse("truncated: " + std::to_string(bytes.size()) + " bytes, shorter than its header");
  const uint64_t length = get_le(bytes, kMagic.size(), 8);
  const uint32_t crc = static_cast<uint32_t>(get_le(bytes, kMagic.size() + 8, 4));
  const std::string body = bytes.substr(kHeaderBytes);
  if (body.size() != length)
    throw refuse("truncated or padded: the header promises " + std::to_string(length) + " bytes of state, the file holds " +
                 std::to_string(body.size()));
  if (crc32(body) != crc) throw refuse("corrupt: its checksum does not match");
  v1::AgentState state;
  if (!state.ParseFromString(body)) throw refuse("corrupt: the state does not parse");
  return state;
}

std::optional<v1::AgentState> StateStore::load() const {
  std::error_code ec;
  if (!fs::exists(file_, ec)) return std::nullopt;
  std::string bytes;
  try {
    bytes = read_file(file_.string());
  } catch (const moe::Error& e) {
    throw StateFileError(std::string("agent state file: ") + e.what());
  }
  return decode(bytes, file_.string());
}

void StateStore::save(const v1::AgentState& state) const { write_file_atomically(file_.string(), encode(state)); }

}  // namespace moe::agent
