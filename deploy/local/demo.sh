#!/usr/bin/env bash
# The main demo: installs missing Debian packages, configures, builds, then runs
# the single-rank MoE layer benchmark (forward and train) on the CPU backend.
# The local cluster (moectl cluster up + a job) replaces this once it exists.
set -euo pipefail
source "$(dirname "$0")/common.sh"

moe_install_deps
moe_build
bench="$MOE_BUILD_DIR/daemon/bench/moe-bench"
threads=$(nproc)
log "demo: single-rank MoE layer on the CPU backend, $threads threads (the cluster is not built yet)"
"$bench" layer --tokens 4096 --hidden 1024 --ffn 512 --experts 64 --top-k 8 --mode forward --threads "$threads"
"$bench" layer --tokens 4096 --hidden 1024 --ffn 512 --experts 64 --top-k 8 --mode train --threads "$threads"
