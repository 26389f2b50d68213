#!/usr/bin/env bash
# The main demo: installs missing Debian packages, configures, builds, then tells
# the story a user came for on a local 2x2 cluster (CPU backend):
#   1. a zipf-skewed train job starts; a few experts get most of the tokens;
#   2. `moectl placement show`: per-expert and per-rank load and balancedness;
#   3. `moectl placement rebalance --redundant-experts 4` while it trains: hot
#      experts are replicated and moved live (no step skipped, no restart);
#   4. the load again, each epoch's balancedness and slowest-rank expert time,
#      the loss curve (the step-20 loss at most half the step-0 loss,
#      docs/jobs.md#teacher-and-loss)
#      and verify (fp64 reference, at a step after the switch).
set -euo pipefail
source "$(dirname "$0")/common.sh"

moe_install_deps
moe_build
bin="$MOE_BUILD_DIR"
export MOE_STATE_DIR="${MOE_STATE_DIR:-$(mktemp -d /tmp/moed-demo.XXXXXX)}"
moectl="$bin/cli/moectl"
trap '"$moectl" cluster down >/dev/null 2>&1 || true' EXIT

log "demo: a 2-node x 2-device cluster on loopback (state in $MOE_STATE_DIR)"
"$moectl" cluster up --nodes 2 --devices-per-node 2

log "demo: a zipf-skewed train job: 16 experts, top-4, 2 layers, 4 ranks, learning a teacher"
id=$("$moectl" job submit --mode train --experts 16 --top-k 4 --hidden 64 --ffn-hidden 64 \
  --tokens-per-rank 1024 --layers 2 --steps 60 --lr 0.03 --skew zipf:1.2 --verify --verify-step 50)
steps_done() {
  "$moectl" job status "$id" -o json | python3 -c 'import json,sys; print(json.load(sys.stdin)["progress"]["step"])'
}
until [ "$(steps_done)" -ge 15 ]; do sleep 0.2; done

log "demo: the load after 15 steps (pairs per rank and per expert over the window)"
"$moectl" placement show --layer 0

log "demo: rebalance live, with 4 redundant experts (hot experts replicated, copies staged in the background)"
"$moectl" placement rebalance --redundant-experts 4

log "demo: the result: a row per placement epoch (balancedness, slowest-rank expert time, step p50)"
"$moectl" job wait "$id" || true
"$moectl" job status "$id" -o json > "$MOE_STATE_DIR/train.json"

log "demo: the load after the rebalance"
"$moectl" placement show --layer 0

python3 - "$MOE_STATE_DIR/train.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
loss = r["loss"]
print("loss by step:", " ".join(f"{x:.4f}" for x in loss))
ratio = loss[20] / loss[0]
print(f"state {r['state']} | verify at step 50 (after the switch): {'passed' if r['verify']['passed'] else 'FAILED'}"
      f" | step-20 / step-0 loss = {ratio:.3f} (must be <= 0.5)")
ok = (r["state"] == "SUCCEEDED" and ratio <= 0.5 and r["verify"]["passed"]
      and len(r["epochs"]) == 2 and r["epochs"][1]["balancedness"] > r["epochs"][0]["balancedness"])
sys.exit(0 if ok else 1)
PY
"$moectl" cluster down
