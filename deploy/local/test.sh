#!/usr/bin/env bash
# Runs every test: installs missing Debian packages, configures, builds, then ctest;
# then the numeric suites (ctest label numeric) again with the narrowest ISA forced
# on every kernel family, so a machine with AVX-512 checks the AVX2 code too
# (docs/backends.md#isa). Extra arguments go to both ctest runs (e.g. -R layer).
set -euo pipefail
source "$(dirname "$0")/common.sh"

# What forces every kernel family to its narrowest ISA (AVX2 and FMA, the least
# the CPU backend runs on): the backend's own kernels, oneDNN's and OpenBLAS's.
narrowest=(MOE_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OPENBLAS_CORETYPE=Haswell)

moe_install_deps
moe_build
log "running tests"
ctest --test-dir "$MOE_BUILD_DIR" --output-on-failure -j "$MOE_JOBS" "$@"
log "running the numeric suites with the narrowest ISA forced: ${narrowest[*]}"
env "${narrowest[@]}" ctest --test-dir "$MOE_BUILD_DIR" --output-on-failure -j "$MOE_JOBS" -L numeric "$@"
