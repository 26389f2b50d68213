#!/usr/bin/env bash
# deploy/grafana/moed.json against Grafana's published types (npm @grafana/schema) with tsc in
# strict mode: the dashboard is written as a TypeScript literal typed MoeDashboard (each panel's
# options and field config against its panel type's published config) and assigned to the
# published Dashboard type (node/grafana_types.ts, node/grafana_check.ts).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
need_node_modules
work=$NODE_DIR/grafana
rm -rf "$work"
mkdir -p "$work"
cp "$MOE_SRC/tests/deploy/node/grafana_types.ts" "$MOE_SRC/tests/deploy/node/grafana_check.ts" \
  "$MOE_SRC/tests/deploy/node/tsconfig.grafana.json" "$work/"
{
  echo "import type { MoeDashboard } from './grafana_types';"
  printf 'export const dashboard: MoeDashboard = '
  cat "$MOE_SRC/deploy/grafana/moed.json"
  echo ';'
} >"$work/dashboard.gen.ts"
log "tsc $("$NODE_DIR/node_modules/.bin/tsc" --version) on deploy/grafana/moed.json"
(cd "$work" && "$NODE_DIR/node_modules/.bin/tsc" -p tsconfig.grafana.json)
echo "ok: deploy/grafana/moed.json conforms to @grafana/schema $(node -p "require('$NODE_DIR/node_modules/@grafana/schema/package.json').version")"
