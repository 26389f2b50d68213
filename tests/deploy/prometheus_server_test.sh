#!/usr/bin/env bash
# A real Prometheus (Debian's) scraping a local 2x2 cluster through the agent's
# file_sd file, with deploy/prometheus/prometheus.yml (a generated copy: scrape and
# rule evaluation every 1 s, the cluster's targets.json) and rules.yml. A skewed
# train job runs, is rebalanced live (--redundant-experts 4) once Prometheus has
# scraped epoch 1, and is cancelled once it has scraped epoch 2. Then:
# - dashboard_lint.py --exposition: every metric and label name the dashboard and
#   the rules use is exported by a live /metrics of a daemon and of the agent;
# - prometheus_server_check.py, through the HTTP API: moe_expert_tokens_total
#   summed over ranks equals the job's expert_tokens, moe_placement_epoch went
#   1 -> 2, every dashboard query returns data over the job.
# Then a serving job answers a Python client's calls (the package moed, built in
# the build tree beside moectl): every serving panel's queries return data over
# it, and the lint also reads the daemons' /metrics taken while it served.
# usage: prometheus_server_test.sh MOECTL   (moe-agent and moed next to it or in the build tree)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
[ $# -eq 1 ] || fail "usage: $0 MOECTL"
MOECTL=$1
command -v prometheus >/dev/null || need_packages prometheus
need_packages python3 python3-yaml curl
py=/usr/bin/python3
[ -x "$py" ] || py=python3
check() { "$py" "$MOE_SRC/tests/deploy/prometheus_server_check.py" "$@"; }

make_tmp
STATE=$TMP/state
PROM_PID=
cleanup() {
  if [ -n "$PROM_PID" ]; then kill "$PROM_PID" 2>/dev/null || true; wait "$PROM_PID" 2>/dev/null || true; fi
  "$MOECTL" --state-dir "$STATE" cluster down >/dev/null 2>&1 || true
  cleanup_tmp
}
trap cleanup EXIT
ctl() { "$MOECTL" --state-dir "$STATE" "$@"; }

log "cluster up: 2 nodes x 2 devices"
ctl cluster up --nodes 2 --devices-per-node 2 >/dev/null

# The config as deployed, scraping every second, pointed at this cluster's targets.
"$py" - "$MOE_SRC/deploy/prometheus/prometheus.yml" "$TMP/prometheus.yml" "$STATE/prometheus/targets.json" <<'EOF'
import sys, yaml
src, dst, targets = sys.argv[1:]
with open(src) as f:
    c = yaml.safe_load(f)
c["global"]["scrape_interval"] = c["global"]["evaluation_interval"] = "1s"
for sc in c["scrape_configs"]:
    for sd in sc["file_sd_configs"]:
        sd["files"], sd["refresh_interval"] = [targets], "1s"
with open(dst, "w") as f:
    yaml.safe_dump(c, f)
EOF
cp "$MOE_SRC/deploy/prometheus/rules.yml" "$TMP/"
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL=http://127.0.0.1:$port
prometheus --config.file="$TMP/prometheus.yml" --storage.tsdb.path="$TMP/data" \
  --web.listen-address="127.0.0.1:$port" >"$TMP/prometheus.log" 2>&1 &
PROM_PID=$!
log "prometheus $(prometheus --version 2>&1 | head -1 | awk '{print $3}') on $URL"
deadline=$((SECONDS + 30))
until curl -sf "$URL/-/ready" >/dev/null; do
  kill -0 "$PROM_PID" 2>/dev/null || { tail -n 20 "$TMP/prometheus.log" >&2; fail "prometheus exited"; }
  [ $SECONDS -lt $deadline ] || fail "prometheus not ready within 30 s"
  sleep 0.2 # polling its readiness endpoint
done
check wait "$URL" 'count(up{role=~"agent|moed"} == 1)' 3 20 || fail "the agent and both daemons are not all up"

# The job runs until cancelled (cancel stops every rank before the same step, so its result
# counts each step every daemon computed): no race with the machine's speed.
start=$(date +%s.%N)
id=$(ctl job submit --mode train --experts 16 --top-k 4 --layers 2 --hidden 128 --ffn-hidden 64 \
  --tokens-per-rank 256 --steps 1000000 --skew zipf:1.2 --seed 3)
log "$id submitted; waiting for Prometheus to see it run under epoch 1"
check wait "$URL" 'min(count_over_time(moe_placement_epoch[1m]))' 3 20 || fail "no epoch scraped"
check wait "$URL" 'sum(rate(moe_rank_tokens_total[4s]))' 1 20 || fail "no load scraped"
out=$(ctl placement rebalance --redundant-experts 4) || fail "rebalance: $out"
grep -q "rebalance committed.*live in $id" <<<"$out" || fail "the rebalance did not apply to $id mid-job: $out"
log "$(head -1 <<<"$out")"
# Every sample of the last 3 s at epoch 2 on every layer: 3 scrapes of the new map.
check wait "$URL" 'min(min_over_time(moe_placement_epoch[3s]))' 2 20 || fail "epoch 2 not scraped"
# The live /metrics while the job runs: the moe_job_* gauges exist only then.
ctl --output json cluster status >"$TMP/status.json"
read -r agent_metrics node_metrics < <("$py" -c 'import json, sys; s = json.load(open(sys.argv[1]))
print(s["agent_metrics_address"], s["nodes"][0]["metrics_address"])' "$TMP/status.json")
curl -sf "http://$agent_metrics/metrics" >"$TMP/agent.metrics"
curl -sf "http://$node_metrics/metrics" >"$TMP/moed.metrics"
ctl job cancel "$id" >/dev/null
ctl --output json job wait "$id" >"$TMP/result.json" || true
state=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("state"))' "$TMP/result.json") ||
  fail "no result of $id: $(cat "$TMP/result.json")"
[ "$state" = CANCELLED ] || fail "$id ended $state, not cancelled: $(head -c 2000 "$TMP/result.json")"
end=$(date +%s.%N)
log "$id cancelled after $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }') s"

check check "$URL" "$TMP/result.json" "$MOE_SRC/deploy/grafana/moed.json" "$start" "$end"

# A serving job and a client calling both layers until the daemons' /metrics are taken.
sstart=$(date +%s.%N)
sid=$(ctl job submit --mode serve --experts 16 --top-k 4 --layers 2 --hidden 128 --ffn-hidden 64 \
  --tokens-per-rank 64 --skew zipf:1.2 --seed 3)
PYTHONPATH="$(dirname "$(dirname "$(realpath "$MOECTL")")")/python" "$py" - "$STATE" "$sid" >"$TMP/client.log" 2>&1 <<'EOF' &
import sys, time, torch, moed
session = moed.Session(job=sys.argv[2], state_dir=sys.argv[1], name="prometheus-test")
until = time.time() + 60
while time.time() < until:
    for layer in (0, 1):
        session.forward(layer, torch.randn(8, session.hidden))
EOF
client=$!
log "$sid serving; waiting for Prometheus to scrape its calls"
check wait "$URL" 'sum(rate(moe_serve_calls_total[4s]))' 1 30 || { cat "$TMP/client.log" >&2; fail "no calls scraped"; }
check wait "$URL" 'count(moe_serve_calls_total)' 2 20 || fail "not both layers' calls scraped"
read -r node0 node1 < <(ctl --output json cluster status | "$py" -c 'import json, sys; s = json.load(sys.stdin)
print(s["nodes"][0]["metrics_address"], s["nodes"][1]["metrics_address"])')
curl -sf "http://$node0/metrics" >"$TMP/serve0.metrics"
curl -sf "http://$node1/metrics" >"$TMP/serve1.metrics"
sleep 3 # three more scrapes of the calls, for the dashboard's rate windows
kill "$client" 2>/dev/null || true
wait "$client" 2>/dev/null || true
ctl job cancel "$sid" >/dev/null
send=$(date +%s.%N)

# Every metric and label name the dashboard and the rules use, against live /metrics.
"$py" "$MOE_SRC/tests/deploy/dashboard_lint.py" "$MOE_SRC/deploy/grafana/moed.json" \
  "$MOE_SRC/deploy/prometheus/rules.yml" \
  --exposition "$TMP/agent.metrics" --exposition "$TMP/moed.metrics" \
  --exposition "$TMP/serve0.metrics" --exposition "$TMP/serve1.metrics"
check serving "$URL" "$MOE_SRC/deploy/grafana/moed.json" "$sstart" "$send"
