#!/usr/bin/env bash
# deploy/systemd: the units as systemd 252 reads them, and their command lines run for real.
# 1. A scratch root holds the units, the environment file, the sysusers file, the built binaries
#    where ExecStart= points (/usr/local/bin) and the system's own units (for sysinit.target and
#    friends); `systemd-analyze verify --root=` must pass without a single warning, and
#    `systemd-sysusers --root=` must create the service user there.
# 2. The settings the deployment relies on are there (LimitMEMLOCK=infinity, Restart=on-failure,
#    StateDirectory=, the token as a credential, the service user).
# 3. Each ExecStart= is expanded as systemd would (%d, %S, %H, ${VAR} and $VAR from moed.env, with
#    loopback ports and scratch folders) and run: the agent serves, writes its file_sd file into its
#    state dir, the daemon registers under the host name, both stop cleanly on SIGTERM.
# usage: systemd_test.sh MOED MOE_AGENT MOECTL
set -euo pipefail
source "$(dirname "$0")/lib.sh"
moed=$(realpath "${1:?usage: systemd_test.sh MOED MOE_AGENT MOECTL}")
agent=$(realpath "${2:?}")
moectl=$(realpath "${3:?}")
command -v systemd-analyze >/dev/null || need_packages systemd
make_tmp
pids=()
stop_all() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  cleanup_tmp
}
trap stop_all EXIT
units=$MOE_SRC/deploy/systemd

# 1. systemd-analyze verify in a scratch root.
root=$TMP/root
mkdir -p "$root/etc/systemd/system" "$root/usr/local/bin" "$root/etc/default" "$root/etc/moed" \
  "$root/usr/lib/systemd" "$root/usr/lib/sysusers.d"
system_units=/usr/lib/systemd/system
[ -d "$system_units" ] || system_units=/lib/systemd/system
cp -a "$system_units" "$root/usr/lib/systemd/"
cp "$units/moe-agent.service" "$units/moed.service" "$root/etc/systemd/system/"
cp "$units/moed.env" "$root/etc/default/moed"
cp "$units/moed.sysusers" "$root/usr/lib/sysusers.d/moed.conf"
install -m 0755 "$moed" "$agent" "$root/usr/local/bin/"
(umask 077 && echo "verify-token" >"$root/etc/moed/token")
log "systemd-analyze verify ($(systemd-analyze --version | head -1))"
out=$(systemd-analyze verify --root="$root" --man=no --generators=no \
  /etc/systemd/system/moe-agent.service /etc/systemd/system/moed.service 2>&1) || fail "systemd-analyze verify: $out"
[ -z "$out" ] || fail "systemd-analyze verify warns: $out"
touch "$root/etc/passwd" "$root/etc/group"
systemd-sysusers --root="$root" >/dev/null 2>&1 || fail "systemd-sysusers rejects deploy/systemd/moed.sysusers"
grep -q '^moed:' "$root/etc/passwd" || fail "moed.sysusers did not create the user moed"

# 2. What the deployment relies on.
need_line() {
  grep -qx -- "$2" "$units/$1" || fail "$1 lacks the line: $2"
}
for u in moe-agent.service moed.service; do
  need_line "$u" "LimitMEMLOCK=infinity"
  need_line "$u" "Restart=on-failure"
  need_line "$u" "User=moed"
  need_line "$u" "EnvironmentFile=/etc/default/moed"
  need_line "$u" "LoadCredential=token:/etc/moed/token"
  grep -qE -- '--token-file %d/token' "$units/$u" || fail "$u does not read the token from its credentials (%d/token)"
  grep -qE -- '--tls-cert %d/tls-cert --tls-key %d/tls-key --tls-ca %d/tls-ca' "$units/$u" ||
    fail "$u does not take its TLS files from its credentials"
done
need_line moe-agent.service "StateDirectory=moe-agent moe-agent/prometheus"
need_line moed.service "StateDirectory=moed"

# 3. Run the command lines. ExecStart= with its continuation lines joined.
exec_start() {
  awk '/^ExecStart=/ { s = $0; while (s ~ /\\$/) { sub(/\\$/, "", s); getline l; s = s l } print substr(s, 11) }' "$1"
}
# The environment of moed.env, with loopback ports and the agent's address file for the test.
declare -A env
while IFS='=' read -r k v; do
  [[ $k =~ ^[A-Z_]+$ ]] && env[$k]=$v
done <"$units/moed.env"
env[MOE_AGENT_LISTEN]=127.0.0.1:0
env[MOE_AGENT_METRICS]=127.0.0.1:0
env[MOE_AGENT_ARGS]="--address-file $TMP/agent_address"
env[MOED_LISTEN]=127.0.0.1:0
env[MOED_METRICS]=127.0.0.1:0
# Each unit's credentials directory (%d): the token, and TLS files from `moectl tls create`.
"$moectl" tls create "$TMP/tls" --name agent --name node --name moectl --host 127.0.0.1 --host localhost >/dev/null ||
  fail "moectl tls create failed"
for u in moe-agent:agent moed:node; do
  d=$TMP/credentials/${u%%:*}
  mkdir -p "$d"
  cp "$root/etc/moed/token" "$d/token"
  cp "$TMP/tls/${u#*:}.pem" "$d/tls-cert"
  cp "$TMP/tls/${u#*:}.key" "$d/tls-key"
  cp "$TMP/tls/ca.pem" "$d/tls-ca"
done
# The StateDirectory= folders systemd would create under %S.
for u in moe-agent.service moed.service; do
  read -r -a dirs < <(sed -n 's/^StateDirectory=//p' "$units/$u")
  for d in "${dirs[@]}"; do mkdir -p "$TMP/state/$d"; done
done
# expand UNIT LINE: systemd's specifiers and variables; sets argv (split on white space, as $VAR is).
expand() {
  local s=$2 k
  s=${s//%d/$TMP/credentials/$1}
  s=${s//%S/$TMP/state}
  s=${s//%H/$(hostname)}
  for k in "${!env[@]}"; do
    s=${s//\$\{$k\}/${env[$k]}}
    s=${s//\$$k/${env[$k]}}
  done
  [[ $s != *'$'* && $s != *%* ]] || fail "unexpanded variable or specifier in: $s"
  read -r -a argv <<<"$s"
}
# without_flags FLAG...: removes each FLAG (with its value: FLAG VALUE or FLAG=VALUE) from argv.
without_flags() {
  local out=() i=0 f skip
  while [ $i -lt ${#argv[@]} ]; do
    skip=""
    for f in "$@"; do
      if [ "${argv[$i]}" = "$f" ]; then skip=2; elif [[ ${argv[$i]} == "$f="* ]]; then skip=1; fi
    done
    if [ -n "$skip" ]; then i=$((i + skip)); else out+=("${argv[$i]}") && i=$((i + 1)); fi
  done
  argv=("${out[@]}")
}
expand moe-agent "$(exec_start "$units/moe-agent.service")"
[ "${argv[0]}" = /usr/local/bin/moe-agent ] || fail "moe-agent.service runs ${argv[0]}"
pending_out=$(pending_flags moe-agent "$agent")
read -r -d '' -a pending <<<"$pending_out" || true
without_flags "${pending[@]}"
log "moe-agent ${argv[*]:1}"
"$agent" "${argv[@]:1}" >"$TMP/agent.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  [ -s "$TMP/agent_address" ] && break
  kill -0 "${pids[0]}" 2>/dev/null || { cat "$TMP/agent.log" >&2; fail "moe-agent exited with the unit's command line"; }
  sleep 0.1 # polling for the agent's address file
done
[ -s "$TMP/agent_address" ] || fail "moe-agent wrote no address within 10 s"
env[MOE_AGENT]=$(cat "$TMP/agent_address")

expand moed "$(exec_start "$units/moed.service")"
[ "${argv[0]}" = /usr/local/bin/moed ] || fail "moed.service runs ${argv[0]}"
pending_out=$(pending_flags moed "$moed")
read -r -d '' -a pending <<<"$pending_out" || true
without_flags "${pending[@]}"
log "moed ${argv[*]:1}"
(cd "$TMP/state/moed" && exec "$moed" "${argv[@]:1}") >"$TMP/moed.log" 2>&1 &
pids+=($!)
ctl=("$moectl" --agent "${env[MOE_AGENT]}" --token-file "$TMP/credentials/moed/token" --output json
  --tls-cert "$TMP/tls/moectl.pem" --tls-key "$TMP/tls/moectl.key" --tls-ca "$TMP/tls/ca.pem")
registered=""
for _ in $(seq 150); do
  kill -0 "${pids[1]}" 2>/dev/null || { cat "$TMP/moed.log" >&2; fail "moed exited with the unit's command line"; }
  if "${ctl[@]}" cluster status 2>/dev/null | /usr/bin/python3 -c '
import json, sys
nodes = json.load(sys.stdin).get("nodes", [])
sys.exit(0 if any(n.get("name") == sys.argv[1] and n.get("state") == "ALIVE" for n in nodes) else 1)
' "$(hostname)"; then
    registered=yes
    break
  fi
  sleep 0.1 # polling the agent for the registration
done
[ -n "$registered" ] || { cat "$TMP/agent.log" "$TMP/moed.log" >&2; fail "moed did not register as $(hostname) within 15 s"; }
sd=$TMP/state/moe-agent/prometheus/targets.json
[ -s "$sd" ] || fail "the agent wrote no file_sd file at %S/moe-agent/prometheus/targets.json"
/usr/bin/python3 - "$sd" <<'PY' || fail "$sd is not a file_sd list with role=moed and role=agent groups"
import json, sys
groups = json.load(open(sys.argv[1]))
roles = {g["labels"]["role"] for g in groups if g.get("targets") and g["labels"].get("node")}
sys.exit(0 if {"agent", "moed"} <= roles else 1)
PY

# SIGTERM, as systemctl stop sends it: both stop cleanly.
for i in 1 0; do
  kill -TERM "${pids[$i]}"
  rc=0
  wait "${pids[$i]}" || rc=$?
  [ $rc -eq 0 ] || fail "process ${pids[$i]} exited $rc on SIGTERM"
done
pids=()
echo "ok: units verified; their command lines serve, register and stop cleanly"
