#!/usr/bin/env bash
# The expert service's benchmark (docs/benchmarks.md#serving): a 1x1 local cluster on
# loopback, a serving job of the shape below, and moe-serve-bench against it (latency by
# batch and throughput by clients, beside the in-process layer in the same run).
# usage: daemon/bench/serve_bench.sh [moe-serve-bench flags, e.g. --output json]
# env:   MOE_BUILD_DIR (default build/), SHAPE (the job's flags), MAX_WAIT (--serve-max-wait-ms)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${MOE_BUILD_DIR:-$root/build}
SHAPE=${SHAPE:---experts 64 --top-k 8 --hidden 1024 --ffn-hidden 512 --tokens-per-rank 256}
MAX_WAIT=${MAX_WAIT:-5}
state=$(mktemp -d /tmp/moe-serve-bench.XXXXXX)
ctl() { "$build/cli/moectl" --state-dir "$state" "$@"; }
cleanup() {
  ctl cluster down >/dev/null 2>&1 || true
  rm -rf "$state"
}
trap cleanup EXIT
ctl cluster up --nodes 1 --devices-per-node 1 --backend cpu >/dev/null
# shellcheck disable=SC2086 # SHAPE is a list of flags
id=$(ctl job submit --mode serve $SHAPE --serve-max-wait-ms "$MAX_WAIT")
"$build/daemon/bench/moe-serve-bench" --state-dir "$state" --job "$id" --threads "$(nproc)" "$@"
ctl job cancel "$id" >/dev/null
