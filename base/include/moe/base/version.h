// What a binary says to --version (docs/cli.md#conventions): the release, the
// git commit it was built from (git describe at build time), the build type and
// whether the CUDA backend was compiled in.
#pragma once

#include <string>

namespace moe {

// "moectl 0.1.0 (git v0.1.0-12-g84e9a1c-dirty), Release build, CUDA backend: compiled in"
std::string version_line(const std::string& program);
// "v0.1.0-12-g84e9a1c-dirty"
const char* git_describe();

}  // namespace moe
