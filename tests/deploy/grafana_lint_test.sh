#!/usr/bin/env bash
# Structural checks of the dashboard and the rules (dashboard_lint.py): variables, panels with
# queries, metric and label names from docs/metrics.md or rules.yml only, no `job` label, the
# promised panels present.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
need_packages python3 python3-yaml
# Debian's python3, where python3-yaml lives (not a virtualenv's that may come first on PATH).
py=/usr/bin/python3
[ -x "$py" ] || py=python3
"$py" "$MOE_SRC/tests/deploy/dashboard_lint.py" "$MOE_SRC/deploy/grafana/moed.json" \
  "$MOE_SRC/deploy/prometheus/rules.yml"
