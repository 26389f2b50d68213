// The agent's state directory (docs/placement.md#agent-persistence; the layout in
// docs/formats.md#agent-state): one file, agent_state.pb, replaced atomically (a
// new file, fsync, rename) whenever the state changes, so a restarted agent reads
// back the last whole state. Layout: the magic line
// "moe-agent-state 1\n", the body's length (8 bytes) and CRC-32 (4 bytes), both
// little-endian, then the body: a serialized v1::AgentState. A torn, truncated
// or foreign file is refused naming the file, never half-read.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include "moe/base/check.h"
#include "moe/v1/agent_state.pb.h"

namespace moe::agent {

// The state file cannot be used; the message names the file and why.
class StateFileError : public moe::Error {
 public:
  using moe::Error::Error;
};

class StateStore {
 public:
  // Creates the folder if needed; throws StateFileError naming it when it cannot.
  explicit StateStore(const std::filesystem::path& dir);
  const std::filesystem::path& file() const { return file_; }

  // The saved state, or nullopt when there is none yet (a fresh agent).
  // Throws StateFileError naming the file when it cannot be read or is damaged.
  std::optional<v1::AgentState> load() const;
  // Replaces the file atomically. Throws moe::Error naming the file.
  void save(const v1::AgentState& state) const;

  // The file's bytes for a state, and back (throws StateFileError naming `file`).
  static std::string encode(const v1::AgentState& state);
  static v1::AgentState decode(const std::string& bytes, const std::string& file);

 private:
  std::filesystem::path file_;
};

}  // namespace moe::agent
