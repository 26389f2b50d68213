#include "moe/base/version.h"

#include "git_describe.inc"

namespace moe {

const char* git_describe() { return kMoeGitDescribe; }

std::string version_line(const std::string& program) {
  return program + " " + MOE_VERSION + " (git " + kMoeGitDescribe + "), " + MOE_BUILD_TYPE + " build, CUDA backend: " +
         (MOE_CUDA_COMPILED ? "compiled in" : "not compiled in");
}

}  // namespace moe
