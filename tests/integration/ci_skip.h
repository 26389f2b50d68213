// A test that cannot run here for a missing prerequisite (root, a package, a kernel
// feature) skips, naming it; under CI=true it fails instead: CI runs as root with every
// package the scripts install, so there a skip would hide a broken prerequisite.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace moe::test {

inline bool in_ci() {
  const char* ci = std::getenv("CI");
  return ci && std::string(ci) == "true";
}

}  // namespace moe::test

#define MOE_SKIP_OR_FAIL_IN_CI(why)                                                            \
  do {                                                                                         \
    if (::moe::test::in_ci()) GTEST_FAIL() << why << " (CI=true: every prerequisite must be present)"; \
    GTEST_SKIP() << why;                                                                       \
  } while (0)
