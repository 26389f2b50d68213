#!/usr/bin/env bash
# The cluster benchmark table (docs/benchmarks.md#cluster-jobs-beside-the-bare-layer): `moectl job submit --wait
# --output json` for forward and train, fp32 and bf16, on 1x1, 1x2, 2x1 and 2x2
# local clusters (T tokens per rank), beside `moe-bench layer` (one rank, the
# same per-rank shape) and `moe-bench ep --ranks 2`; prints a Markdown table and,
# per job, where its step time goes (the result's phases, each the median over
# steps of the slowest rank's; "other" is the rest: residual adds, the loss, the
# step's agreement all-reduce, the report, and skew between the ranks' phases).
#
#   daemon/bench/cluster_table.sh [TOKENS HIDDEN FFN EXPERTS TOPK FORWARD_STEPS TRAIN_STEPS]
# Defaults: 2048 1024 512 64 8 6 4.
set -euo pipefail
build=${MOE_BUILD_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/build}
moectl="$build/cli/moectl" bench="$build/daemon/bench/moe-bench"
tokens=${1:-2048} hidden=${2:-1024} ffn=${3:-512} experts=${4:-64} topk=${5:-8}
fsteps=${6:-6} tsteps=${7:-4}
out=$(mktemp -d /tmp/moe-cluster-table.XXXXXX)
export MOE_STATE_DIR="$out/state"
trap '"$moectl" cluster down >/dev/null 2>&1 || true; rm -rf "$out"' EXIT
shape=(--experts "$experts" --top-k "$topk" --hidden "$hidden" --ffn-hidden "$ffn" --tokens-per-rank "$tokens")

for dtype in fp32 bf16; do
  for mode in forward train; do
    "$bench" layer --tokens "$tokens" --hidden "$hidden" --ffn "$ffn" --experts "$experts" --top-k "$topk" \
      --threads 2 --iters 5 --mode "$mode" --dtype "$dtype" --output json > "$out/layer_${dtype}_${mode}.json"
  done
  # The job's layer figure includes its optimizer step: the bare layer with Adam too.
  "$bench" layer --tokens "$tokens" --hidden "$hidden" --ffn "$ffn" --experts "$experts" --top-k "$topk" \
    --threads 2 --iters 5 --mode train --optimizer adam --dtype "$dtype" --output json > "$out/layer_${dtype}_adam.json"
  "$bench" ep --ranks 2 --tokens "$tokens" --hidden "$hidden" --ffn "$ffn" --experts "$experts" --top-k "$topk" \
    --iters 3 --dtype "$dtype" --transport ucx --no-perftest --output json > "$out/ep_${dtype}.json"
done
for nd in "1 1" "1 2" "2 1" "2 2"; do
  read -r n d <<< "$nd"
  "$moectl" cluster up --nodes "$n" --devices-per-node "$d" > /dev/null
  for dtype in fp32 bf16; do
    "$moectl" --output json job submit --wait "${shape[@]}" --dtype "$dtype" --steps "$fsteps" > "$out/job_${n}x${d}_${dtype}_forward.json"
    "$moectl" --output json job submit --wait "${shape[@]}" --dtype "$dtype" --steps "$tsteps" --mode train > "$out/job_${n}x${d}_${dtype}_train.json"
  done
  "$moectl" cluster down > /dev/null
done

python3 - "$out" <<'PY'
import json, sys, glob
d = sys.argv[1]
load = lambda p: json.load(open(p))
layer = {(dt, m): load(f"{d}/layer_{dt}_{m}.json") for dt in ("fp32", "bf16") for m in ("forward", "train", "adam")}
ep = {dt: load(f"{d}/ep_{dt}.json") for dt in ("fp32", "bf16")}
l0 = layer[("fp32", "forward")]
print(f"CPU: {l0['cpu']}, ISA {l0['cpu_isa']}, row GEMM {l0['row_gemm_kernel']}, wgrad engine {l0['gemm_engine']}")
# Ratios against the bare layer are of the whole job (every rank shares this machine's
# cores, so the cluster as a whole has the layer's threads); "layer" drops the
# synthetic task's teacher and inputs (the result's layer_tokens_per_second); train
# jobs also against the bare layer with its Adam step ("+ adam"), like for like.
print("| cluster | dtype | mode | job tokens/s | per rank | job layer tokens/s | moe-bench layer tokens/s | job / layer | job layer / layer | job layer / layer + adam |")
print("|---|---|---|---|---|---|---|---|---|---|")
for nd in ("1x1", "1x2", "2x1", "2x2"):
    ranks = int(nd[0]) * int(nd[2])
    for dt in ("fp32", "bf16"):
        for m in ("forward", "train"):
            j = load(f"{d}/job_{nd}_{dt}_{m}.json")
            tps = j["tokens_per_second"]
            lps = j.get("layer_tokens_per_second", tps)
            ref = layer[(dt, m)]["tokens_per_second"]
            adam = f"{lps / layer[(dt, 'adam')]['tokens_per_second']:.2f}" if m == "train" else ""
            print(f"| {nd} | {dt} | {m} | {tps:,.0f} | {tps / ranks:,.0f} | {lps:,.0f} | {ref:,.0f} | "
                  f"{tps / ref:.2f} | {lps / ref:.2f} | {adam} |")
print()
for dt in ("fp32", "bf16"):
    a = layer[(dt, "adam")]
    print(f"moe-bench layer --mode train --optimizer adam ({dt}): {a['tokens_per_second']:,.0f} tokens/s, "
          f"optimizer {a['phase_seconds']['optimizer']:.3f} s = {a['optimizer_share']:.1%} of the step")
for dt in ("fp32", "bf16"):
    print(f"moe-bench ep --ranks 2 ({dt}, UCX processes): forward {ep[dt]['forward_tokens_per_second']:,.0f} tokens/s, "
          f"train {ep[dt]['train_tokens_per_second']:,.0f}")
print()
keys = ("inputs", "router", "dispatch", "expert", "combine", "teacher", "backward", "optimizer")
print("| job | step p50 s | " + " | ".join(keys) + " | other |")
print("|---|---|" + "---|" * (len(keys) + 1))
for nd in ("1x1", "2x1", "2x2"):
    for dt in ("fp32", "bf16"):
        for m in ("forward", "train"):
            j = load(f"{d}/job_{nd}_{dt}_{m}.json")
            p = j["phase_seconds"]
            other = j["step_seconds_p50"] - sum(p[k] for k in keys)
            print(f"| {nd} {dt} {m} | {j['step_seconds_p50']:.3f} | " + " | ".join(f"{p[k]:.3f}" for k in keys) + f" | {other:.3f} |")
PY
