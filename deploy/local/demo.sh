#!/usr/bin/env bash
# The main demo: installs missing Debian packages, configures, builds, then brings
# up a local cluster on loopback (CPU backend: this build has no CUDA kernels yet),
# runs a forward job on it, prints the result, and takes the cluster down. Then the
# single-rank layer benchmark, for the kernels' efficiency.
set -euo pipefail
source "$(dirname "$0")/common.sh"

moe_install_deps
moe_build
bin="$MOE_BUILD_DIR"
export MOE_STATE_DIR="${MOE_STATE_DIR:-$(mktemp -d /tmp/moed-demo.XXXXXX)}"
moectl="$bin/cli/moectl"
trap '"$moectl" cluster down >/dev/null 2>&1 || true' EXIT

log "demo: a 2-node x 1-device cluster on loopback (state in $MOE_STATE_DIR)"
"$moectl" cluster up --nodes 2 --devices-per-node 1
log "demo: a verified forward job (small, checked against the fp64 reference)"
"$moectl" job submit --wait --experts 16 --top-k 4 --hidden 256 --ffn-hidden 128 \
  --tokens-per-rank 256 --layers 2 --steps 3 --skew zipf:1.0 --verify
log "demo: the main forward job (E=64, top-8, H=1024, I=512, 2048 tokens per rank, 2 layers)"
"$moectl" job submit --wait --experts 64 --top-k 8 --hidden 1024 --ffn-hidden 512 \
  --tokens-per-rank 2048 --layers 2 --steps 5 --skew zipf:1.0
"$moectl" placement show | head -5
"$moectl" cluster down

log "demo: the single-rank layer benchmark (fraction of the same-run GEMM peak)"
"$bin/daemon/bench/moe-bench" layer --tokens 4096 --hidden 1024 --ffn 512 --experts 64 --top-k 8 \
  --mode forward --threads "$(nproc)"
