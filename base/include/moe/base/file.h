// Files that must survive a crash whole or not at all.
#pragma once

#include <string>

namespace moe {

// Replaces `path` with `contents` atomically: writes path + ".tmp", fsyncs it,
// renames it over path and fsyncs the folder, so a reader (or a restart) sees the
// old file or the new one, never a torn one. Throws moe::Error naming the path
// and the failing step.
void write_file_atomically(const std::string& path, const std::string& contents);

// The whole file; throws moe::Error naming the path when it cannot be read.
std::string read_file(const std::string& path);

}  // namespace moe
