#!/usr/bin/env bash
# One command for the example model (docs/example-lm.md): a local cluster, the
# serving job of its MoE layers, training (with --compare: beside the same model
# in PyTorch), an optional generation, and the cluster down again.
# usage: examples/moe_lm/run.sh [moe_lm.py flags, e.g. --compare --generate 200]
# env:   MOE_BUILD_DIR (default build/), NODES, DEVICES, LAYERS, HIDDEN, EXPERTS,
#        STEPS, BATCH, SEQ; TRACE_DIR: record the job's routing and rows there
#        (TRACE_TOKENS per layer and rank, default 65536; docs/example-lm.md#routing-traces)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${MOE_BUILD_DIR:-$root/build}
NODES=${NODES:-2} DEVICES=${DEVICES:-2} LAYERS=${LAYERS:-4} HIDDEN=${HIDDEN:-128} EXPERTS=${EXPERTS:-16}
STEPS=${STEPS:-300} BATCH=${BATCH:-8} SEQ=${SEQ:-128}
state=$(mktemp -d /tmp/moe-lm.XXXXXX)
ctl() { "$build/cli/moectl" --state-dir "$state" "$@"; }
cleanup() {
  ctl cluster down >/dev/null 2>&1 || true
  rm -rf "$state"
}
trap cleanup EXIT
ctl cluster up --nodes "$NODES" --devices-per-node "$DEVICES" --backend cpu >/dev/null
# A call is a batch's rows (BATCH x SEQ), at most one step of the node that takes it.
tokens=$(((BATCH * SEQ + DEVICES - 1) / DEVICES))
job=$(ctl job submit --mode serve --serve-train --optimizer adam --lr 0.001 --experts "$EXPERTS" --top-k 2 \
  --hidden "$HIDDEN" --ffn-hidden "$HIDDEN" --layers "$LAYERS" --shared-experts 1 --shared-ffn-hidden "$HIDDEN" \
  --tokens-per-rank "$tokens" --serve-max-wait-ms 1 --name moe-lm \
  ${TRACE_DIR:+--trace-dir "$TRACE_DIR" --trace-tokens "${TRACE_TOKENS:-65536}" --trace-hidden})
echo "cluster ${NODES}x${DEVICES} in $state, serving job $job"
MOECTL="$build/cli/moectl" PYTHONPATH="$build/python" /usr/bin/python3 "$root/examples/moe_lm/moe_lm.py" --state-dir "$state" --job "$job" \
  --steps "$STEPS" --batch "$BATCH" --seq "$SEQ" "$@"
ctl job cancel "$job" >/dev/null
if [ -n "${TRACE_DIR:-}" ]; then  # the ranks write their traces as the job ends
  for _ in $(seq 100); do
    [ "$(find "$TRACE_DIR" -maxdepth 1 -name 'routing-rank*.safetensors' 2>/dev/null | wc -l)" -ge $((NODES * DEVICES)) ] &&
      break
    sleep 0.1
  done
  echo "routing traces in $TRACE_DIR:" "$TRACE_DIR"/routing-rank*.safetensors
fi
