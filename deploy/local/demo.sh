#!/usr/bin/env bash
# The main demo: installs missing Debian packages, configures, builds, then brings
# up a local cluster on loopback (CPU backend: this build has no CUDA kernels yet)
# and runs the main job, a train job whose step-20 loss must be at most half its
# step-0 loss (DESIGN 6), then a verified forward job and a larger forward job, and
# takes the cluster down. Last, the single-rank layer benchmark.
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
log "demo: the main job: train a 2-layer MoE (16 experts, top-4) to match a teacher, gradients verified"
"$moectl" --output json job submit --wait --mode train --experts 16 --top-k 4 --hidden 16 --ffn-hidden 16 \
  --tokens-per-rank 1024 --layers 2 --steps 21 --lr 0.05 --verify > "$MOE_STATE_DIR/train.json"
python3 - "$MOE_STATE_DIR/train.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
loss = r["loss"]
print("state", r["state"], "| verify passed:", r["verify"]["passed"])
print("loss by step:", " ".join(f"{x:.4f}" for x in loss))
ratio = loss[20] / loss[0]
print(f"step-20 / step-0 loss = {ratio:.3f} (must be <= 0.5)")
sys.exit(0 if r["state"] == "JOB_STATE_SUCCEEDED" and ratio <= 0.5 and r["verify"]["passed"] else 1)
PY
log "demo: a verified forward job (small, checked against the fp64 reference)"
"$moectl" job submit --wait --experts 16 --top-k 4 --hidden 256 --ffn-hidden 128 \
  --tokens-per-rank 256 --layers 2 --steps 3 --skew zipf:1.0 --verify
log "demo: a larger forward job (E=64, top-8, H=1024, I=512, 2048 tokens per rank, 2 layers)"
"$moectl" job submit --wait --experts 64 --top-k 8 --hidden 1024 --ffn-hidden 512 \
  --tokens-per-rank 2048 --layers 2 --steps 5 --skew zipf:1.0
"$moectl" placement show | head -5
"$moectl" cluster down

log "demo: the single-rank layer benchmark (fraction of the same-run GEMM peak)"
"$bin/daemon/bench/moe-bench" layer --tokens 4096 --hidden 1024 --ffn 512 --experts 64 --top-k 8 \
  --mode forward --threads "$(nproc)"
