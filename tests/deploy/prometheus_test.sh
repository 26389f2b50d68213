#!/usr/bin/env bash
# deploy/prometheus with the real promtool: the config (with an example of the agent's file_sd
# file, which promtool then validates too), the rules, and the rules' unit tests on synthetic
# series (prometheus/rules_test.yml).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
command -v promtool >/dev/null || need_packages prometheus
make_tmp
trap cleanup_tmp EXIT

log "promtool $(promtool --version 2>&1 | head -1 | awk '{print $3}')"
# The config as deployed next to a targets/ folder holding a file in the agent's format.
cp "$MOE_SRC/deploy/prometheus/prometheus.yml" "$MOE_SRC/deploy/prometheus/rules.yml" "$TMP/"
mkdir "$TMP/targets"
cp "$MOE_SRC/tests/deploy/prometheus/targets.example.json" "$TMP/targets/local.json"
promtool check config "$TMP/prometheus.yml"
grep -q 'SUCCESS' <(promtool check config "$TMP/prometheus.yml" 2>&1) || fail "promtool check config"

promtool check rules "$MOE_SRC/deploy/prometheus/rules.yml"
promtool test rules "$MOE_SRC/tests/deploy/prometheus/rules_test.yml"
