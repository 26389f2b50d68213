#!/usr/bin/env bash
# Runs every test: installs missing Debian packages, configures, builds, then ctest.
# Extra arguments go to ctest (e.g. -R layer, or -L unit).
set -euo pipefail
source "$(dirname "$0")/common.sh"

moe_install_deps
moe_build
log "running tests"
ctest --test-dir "$MOE_BUILD_DIR" --output-on-failure -j "$MOE_JOBS" "$@"
