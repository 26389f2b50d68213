#!/usr/bin/env bash
# deploy/k8s: the generated manifests are up to date (deploy/k8s/generate.sh), every object
# validates against the published Kubernetes / prometheus-operator schemas (npm kubernetes-models,
# @kubernetes-models/prometheus-operator) and type-checks as a literal of its published type
# (tsc: unknown fields), the cross-object checks of node/k8s_validate.mjs pass, and every flag a
# container passes is one the built binary accepts.
# usage: k8s_test.sh MOED MOE_AGENT
set -euo pipefail
source "$(dirname "$0")/lib.sh"
moed=$(realpath "${1:?usage: k8s_test.sh MOED MOE_AGENT}")
agent=$(realpath "${2:?usage: k8s_test.sh MOED MOE_AGENT}")
make_tmp
trap cleanup_tmp EXIT

"$MOE_SRC/deploy/k8s/generate.sh" "$TMP"
for f in grafana-dashboard.yaml prometheusrule.yaml; do
  diff -u "$MOE_SRC/deploy/k8s/$f" "$TMP/$f" >/dev/null ||
    fail "deploy/k8s/$f is not what deploy/k8s/generate.sh makes from its source: run it"
done
need_node_modules

"$moed" --help >"$TMP/moed.help"
"$agent" --help >"$TMP/moe-agent.help"
# Flags the binaries do not accept yet (MOE_PENDING_FLAGS) pass the flag check, with a NOTE.
pending_flags moed "$moed" | sed 's/^/  /' >>"$TMP/moed.help"
pending_flags moe-agent "$agent" | sed 's/^/  /' >>"$TMP/moe-agent.help"
work=$NODE_DIR/k8s
rm -rf "$work"
mkdir -p "$work"
cp "$MOE_SRC/tests/deploy/node/k8s_validate.mjs" "$MOE_SRC/tests/deploy/node/tsconfig.k8s.json" "$work/"
rc=0
node "$work/k8s_validate.mjs" --dir "$MOE_SRC/deploy/k8s" --dashboard "$MOE_SRC/deploy/grafana/moed.json" \
  --rules "$MOE_SRC/deploy/prometheus/rules.yml" --ts "$work/k8s.gen.ts" \
  --help "moed=$TMP/moed.help" --help "moe-agent=$TMP/moe-agent.help" || rc=1
log "tsc on the manifests as typed literals"
(cd "$work" && "$NODE_DIR/node_modules/.bin/tsc" -p tsconfig.k8s.json) || rc=1
exit $rc
