#!/usr/bin/env bash
# The long thrash run (docs/architecture.md#thrashing): ITERATIONS (default 200) small jobs
# with random faults on a local 2x2 cluster, against the Release build, figures into
# OUT (default thrash.json in the build folder). docs/testing.md quotes the latest.
#   tests/thrash/long_run.sh [ITERATIONS] [SEED] [OUT]
set -euo pipefail
source "$(dirname "$0")/../../deploy/local/common.sh"
iterations=${1:-200}
seed=${2:-$(date +%s)}
out=${3:-$MOE_BUILD_DIR/thrash.json}
moe_install_deps
moe_build
log "thrash: $iterations iterations, seed $seed"
exec python3 "$MOE_ROOT/tests/thrash/thrash.py" --bin-dir "$MOE_BUILD_DIR" --iterations "$iterations" --seed "$seed" \
  --work "$MOE_BUILD_DIR/thrash-long" --json "$out"
