// Files that must survive a crash whole or not at all.
#pragma once

#include <string>

namespace moe {

// Replaces `path` with `contents` atomically: writes path + ".tmp", fsyncs it,
// renames it over path and fsyncs the folder, so a reader (or a restart) sees the
// old file or the new one, never a torn one. Throws moe::Error naming the path
// and the failing step. A new file gets `mode` from its creation on (0600 for a
// secret, never readable by others in between).
void write_file_atomically(const std::string& path, const std::string& contents, unsigned mode = 0644);

// The whole file; throws moe::Error naming the path when it cannot be read.
std::string read_file(const std::string& path);

}  // namespace moe
