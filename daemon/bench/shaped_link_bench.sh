#!/usr/bin/env bash
# Shaped-link benchmark (issue: communication hidden behind compute): the agent and N daemons in
# network namespaces of their own, joined by veth pairs to a bridge in a "switch" namespace,
# `tc tbf` (and, with DELAY, `netem` delay) on every daemon's veth; forward and train jobs through
# moectl at each link rate. Prints per mode and rate: tokens/s, the phases (dispatch, expert,
# combine, backward), the communication seconds a step needs at that rate (the step's bytes per
# rank over the link), the bound max(compute, communication) and the step's ratio to it. Compute
# is the fastest unshaped step of the same mode and wire when "none" runs first (serial and
# chunked do the same work), else the job's expert, router and backward phases. The last column is the step over the per-pass bound: the sum over a train
# step's passes (teacher forward, forward, backward) of max(pass compute, pass transfer), plus the
# phases without transfers: the best that overlap within each pass can reach.
#
#   sudo daemon/bench/shaped_link_bench.sh [RATES] [STEPS]
#     RATES: space-separated tbf rates, "none" = unshaped (default: "none 10gbit 1gbit 200mbit")
#     STEPS: steps per job (default 6; the medians skip nothing, the first step included)
#   Environment: NODES (2), DEVICES (1), JOB (the moectl job flags; default E=64 K=8 H=1024 I=512
#   T=2048), OVERLAP (the --overlap-chunks values to compare, default "1 0": serial, then chosen
#   per step; docs/layer.md#overlap), WIRES (the wire formats to compare, default "layer": layer =
#   the job's dtype, bf16 = bf16 dispatch and combine, fp8 = fp8 dispatch and bf16 combine; each
#   runs with the last OVERLAP value; docs/layer.md#wire-formats), REPEAT (jobs per configuration,
#   default 1: the one with the median step stands for it, `spread` says how far they differ), DELAY (e.g. 1ms: netem delay on each veth, none by default),
#   KEEP (set: the logs and each job's result stay in the work folder), MOE_BUILD_DIR; the
#   daemons inherit the environment.
# Needs root, iproute2 and tc; without them it says what is missing and exits 0 (a skip; under
# CI=true, where CI has them, 1).
set -euo pipefail
build=${MOE_BUILD_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/build}
rates=${1:-"none 10gbit 1gbit 200mbit"}
steps=${2:-6}
nodes=${NODES:-2}
devices=${DEVICES:-1}
job=${JOB:-"--experts 64 --top-k 8 --hidden 1024 --ffn-hidden 512 --tokens-per-rank 2048"}
overlaps=${OVERLAP:-"1 0"}
wires=${WIRES:-layer}
repeat=${REPEAT:-1}
wire_flags() {
  case $1 in
    layer) ;;
    bf16) echo "--dispatch-wire bf16 --combine-wire bf16" ;;
    fp8) echo "--dispatch-wire fp8 --combine-wire bf16" ;;
    *) echo "shaped_link_bench: unknown wire '$1' (layer | bf16 | fp8)" >&2; exit 2 ;;
  esac
}
skip() {
  echo "shaped_link_bench: skipped: $*"
  [ "${CI:-}" != true ] || exit 1
  exit 0
}
[ "$(id -u)" = 0 ] || skip "needs root (network namespaces and tc)"
command -v ip >/dev/null || skip "needs iproute2 (ip)"
command -v tc >/dev/null || skip "needs tc (iproute2)"

id=$$
sw=msw$id br=mbr$id subnet="10.$((id % 200 + 20)).$((id / 200 % 250)).0"
net=${subnet%.0}
work=$(mktemp -d /tmp/moe-shaped.XXXXXX)
pids=()
cleanup() {
  # Every process of our namespaces (in_ns runs them through a subshell: its pid is not theirs).
  for i in $(seq 0 "$nodes"); do
    ip netns pids "mh$id-$i" 2>/dev/null | xargs -r kill 2>/dev/null || true
  done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for i in $(seq 0 "$nodes"); do ip netns del "mh$id-$i" 2>/dev/null || true; done
  ip netns del "$sw" 2>/dev/null || true
  if [ -n "${KEEP:-}" ]; then echo "logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
ip netns add "$sw" || skip "cannot create network namespaces here"
ip -n "$sw" link add "$br" type bridge && ip -n "$sw" link set "$br" up
for i in $(seq 0 "$nodes"); do  # host 0: the agent; hosts 1..N: the daemons
  ns=mh$id-$i
  ip netns add "$ns"
  ip -n "$sw" link add "s$id-$i" type veth peer name eth0 netns "$ns"
  ip -n "$sw" link set "s$id-$i" master "$br" up
  ip -n "$ns" addr add "$net.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
done
addr() { echo "$net.$(($1 + 1))"; }
in_ns() { local i=$1; shift; ip netns exec "mh$id-$i" "$@"; }

echo netns-bench > "$work/token"
export UCX_TLS=tcp UCX_NET_DEVICES=eth0
in_ns 0 "$build/agent/moe-agent" --plaintext --listen "$(addr 0):7400" --token-file "$work/token" \
  --address-file "$work/agent_address" >"$work/agent.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$work/agent_address" ] && break; sleep 0.1; done  # polling for the agent
agent=$(cat "$work/agent_address")
for i in $(seq 1 "$nodes"); do
  in_ns "$i" "$build/daemon/moed" --plaintext --agent "$agent" --devices "$devices" --listen "$(addr "$i"):0" \
    --token-file "$work/token" --name "host$i" >"$work/node$i.log" 2>&1 &
  pids+=($!)
done
ctl() { in_ns 0 "$build/cli/moectl" --plaintext --agent "$agent" --token-file "$work/token" "$@"; }
for _ in $(seq 200); do  # polling for the registrations
  ctl --output json cluster status 2>/dev/null | grep -q "\"registered_ranks\": $((nodes * devices))" && break
  sleep 0.1
done

shape() {  # every daemon's veth, switch side (what it receives) and host side (what it sends)
  local rate=$1
  for i in $(seq 1 "$nodes"); do
    for dev in "s$id-$i@$sw" "eth0@mh$id-$i"; do
      local d=${dev%@*} n=${dev#*@}
      tc -n "$n" qdisc del dev "$d" root 2>/dev/null || true
      [ "$rate" = none ] && continue
      if [ -n "${DELAY:-}" ]; then
        tc -n "$n" qdisc add dev "$d" root netem delay "$DELAY" rate "$rate"
      else
        tc -n "$n" qdisc add dev "$d" root tbf rate "$rate" burst 256kb latency 100ms
      fi
    done
  done
}

cpu=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
echo "shaped links: $nodes daemon(s) x $devices device(s) in network namespaces; $cpu, $(nproc) cores; $(date -u +%F)"
echo "job: $job, $steps steps, $repeat job(s) a configuration; UCX over TCP${DELAY:+; netem delay $DELAY}"
printf "%-8s %-9s %-7s %-5s %10s %9s %9s %9s %9s %9s %9s %10s %9s %7s %7s %6s\n" mode link overlap wire tokens/s step_s \
  dispatch expert combine teacher backward comm_s bound_s step/bd pass/bd spread
for mode in ${MODES:-forward train}; do
  for rate in $rates; do
    shape "$rate"
    last_ov=${overlaps##* }
    runs=$(for ov in $overlaps; do echo "$ov:layer"; done; for w in $wires; do [ "$w" = layer ] || echo "$last_ov:$w"; done)
    for run in $runs; do
    ov=${run%%:*} wire=${run#*:}
    results=()
    for rep in $(seq "$repeat"); do
      # shellcheck disable=SC2086,SC2046 # the job's flags are words
      ctl --output json job submit --wait --mode "$mode" $job --steps "$steps" --overlap-chunks "$ov" \
        $(wire_flags "$wire") >"$work/job-$mode-$rate-$ov-$wire-$rep.json" || { echo "$mode $rate overlap $ov wire $wire: the job failed"; continue; }
      results+=("$work/job-$mode-$rate-$ov-$wire-$rep.json")
    done
    [ ${#results[@]} -gt 0 ] || continue
    python3 - "$mode" "$rate" "$nodes" "$devices" "$ov" "$work/unshaped-$mode-$wire" "$wire" "${results[@]}" <<'PY'
import json, os, re, sys
mode, rate, nodes, devices, ov = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
unshaped_file, wire = sys.argv[6], sys.argv[7]
# The run with the median step time stands for the configuration (its phases with it); spread is
# (slowest - fastest) / median over the runs.
runs = sorted((json.load(open(f)) for f in sys.argv[8:]), key=lambda j: j["step_seconds_p50"])
r = runs[(len(runs) - 1) // 2]
spread = (runs[-1]["step_seconds_p50"] - runs[0]["step_seconds_p50"]) / r["step_seconds_p50"]
ph, steps = r["phase_seconds"], max(1, int(r["steps_completed"]))
ranks = nodes * devices
# The bytes one rank hands the transport per step for other ranks, of which the share for ranks
# on other nodes crosses its link: against the shaped rate (each direction of a veth has it), what
# communication alone needs. The job reports the layer's forward pair (dispatch + combine); a
# train step also runs the backward pair (the same rows, the other way) and the teacher's forward
# pair (a layer of the same shape over the same tokens): three times the layer's forward bytes,
# to within the per-row metadata.
passes = 3 if mode == "train" else 1
per_rank = (r["dispatch_bytes"] + r["combine_bytes"]) / steps / ranks * passes
remote = per_rank * (ranks - devices) / (ranks - 1) if ranks > 1 else 0.0
m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg])bit", rate)
bps = float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] if m else 0.0
comm = remote * 8 / bps if bps else 0.0
# Compute: the fastest unshaped step of this mode and wire (serial and chunked are the same work;
# the faster one is the conservative bound), else this run's compute phases.
step = r["step_seconds_p50"]
if rate == "none" and (not os.path.exists(unshaped_file) or step < json.load(open(unshaped_file))["step"]):
    json.dump({"step": step, "phases": ph}, open(unshaped_file, "w"))
if os.path.exists(unshaped_file):
    u = json.load(open(unshaped_file))
    compute, uph = u["step"], u["phases"]
else:
    compute, uph = ph.get("expert", 0) + ph.get("router", 0) + ph.get("backward", 0), None
bound = max(compute, comm)
# The per-pass bound: a pass's transfers hide only behind that pass's compute, so a step is at
# best the sum over its passes (train: the teacher's forward, the layer's forward, the backward)
# of max(the pass's unshaped seconds, its transfer), plus what has no transfer (optimizer, inputs).
pass_bound = bound
if mode == "train" and uph:
    fwd = sum(uph.get(k, 0) for k in ("router", "dispatch", "expert", "combine"))
    timed = [uph.get("teacher", 0), fwd, uph.get("backward", 0)]
    pass_bound = sum(max(t, comm / passes) for t in timed) + max(0.0, compute - sum(timed))
print("%-8s %-9s %-7s %-5s %10.0f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %10.3f %9.3f %7.2f %7.2f %6.2f" % (
    mode, rate, ("auto:%d" if ov == 0 else "%d") % r.get("overlap_chunks", 1) if ov != 1 else "serial", wire,
    r["tokens_per_second"], step, ph.get("dispatch", 0), ph.get("expert", 0), ph.get("combine", 0),
    ph.get("teacher", 0), ph.get("backward", 0), comm, bound, step / bound if bound else 0, step / pass_bound if pass_bound else 0,
    spread))
PY
    done
  done
done
shape none
