#!/usr/bin/env bash
# Live-rebalance benchmark (docs/placement.md#live-rebalance): a local cluster, a zipf-skewed
# train job, `moectl placement rebalance` mid-job; prints per epoch the measured
# balancedness (pairs), tokens/s from the median step, the slowest rank's expert
# time, and the switch's stall (the new epoch's first step minus its median).
#
#   daemon/bench/rebalance_bench.sh [NODES DEVICES EXPERTS TOPK HIDDEN FFN TOKENS REDUNDANT STEPS AT]
# Defaults: 4 2 64 8 512 256 512 16 50 15 (a 4x2 cluster, E=64, K=8).
set -euo pipefail
build=${MOE_BUILD_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/build}
moectl="$build/cli/moectl"
nodes=${1:-4} devices=${2:-2} experts=${3:-64} topk=${4:-8} hidden=${5:-512} ffn=${6:-256}
tokens=${7:-512} redundant=${8:-16} steps=${9:-50} at=${10:-15}
export MOE_STATE_DIR
MOE_STATE_DIR=$(mktemp -d /tmp/moe-rebalance-bench.XXXXXX)
trap '"$moectl" cluster down >/dev/null 2>&1 || true; rm -rf "$MOE_STATE_DIR"' EXIT

"$moectl" cluster up --nodes "$nodes" --devices-per-node "$devices" >/dev/null
id=$("$moectl" job submit --mode train --experts "$experts" --top-k "$topk" --hidden "$hidden" \
  --ffn-hidden "$ffn" --tokens-per-rank "$tokens" --steps "$steps" --skew zipf:1.0 --lr 0.001)
steps_done() {
  "$moectl" --output json job status "$id" | python3 -c 'import json,sys; print(int(json.load(sys.stdin)["steps_completed"]))'
}
until [ "$(steps_done)" -ge "$at" ]; do sleep 0.2; done
"$moectl" --output json placement rebalance --redundant-experts "$redundant" > "$MOE_STATE_DIR/rebalance.json"
"$moectl" --output json job wait "$id" > "$MOE_STATE_DIR/job.json"
"$moectl" --output json placement show > "$MOE_STATE_DIR/show.json"
python3 - "$MOE_STATE_DIR" "$nodes" "$devices" "$tokens" <<'PY'
import json, sys
d, nodes, devices, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
job = json.load(open(f"{d}/job.json"))
reb = json.load(open(f"{d}/rebalance.json"))
show = json.load(open(f"{d}/show.json"))
ranks = nodes * devices
print(f"cluster {nodes}x{devices}, job {job['job_id']} {job['state']}, rebalance {reb['result']} "
      f"({len(reb.get('copies', []))} copies, {reb['copy_bytes'] / 1e6:.1f} MB, {reb['seconds']:.2f} s PREPARE->COMMIT)")
pred = reb["predicted_balancedness"][0]
print(f"predicted balancedness of the new map: {pred:.3f}; measured over the last window: "
      f"{show['layers'][0]['balancedness']:.3f} ({show['layers'][0]['balancedness'] / pred:.3f} of predicted)")
print(f"{'epoch':>5} {'steps':>7} {'balancedness':>12} {'tokens/s':>10} {'expert s (slowest)':>19} {'step p50 s':>11} {'first step s':>13}")
for e in job["epochs"]:
    tps = tokens * ranks / e["step_seconds_p50"]
    print(f"{e['epoch']:>5} {e['steps']:>7} {e['balancedness']:>12.3f} {tps:>10.0f} {e['slowest_rank_expert_seconds']:>19.4f} "
          f"{e['step_seconds_p50']:>11.4f} {e['first_step_seconds']:>13.4f}")
if len(job["epochs"]) == 2:
    e = job["epochs"][1]
    stall = e["first_step_seconds"] - e["step_seconds_p50"]
    print(f"switch stall: {stall:+.4f} s = {stall / e['step_seconds_p50']:+.1%} of the new epoch's median step")
PY
