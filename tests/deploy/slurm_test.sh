#!/usr/bin/env bash
# deploy/slurm/moed.sbatch on a real Slurm (Debian's slurm-wlm 22.05): a private one-node cluster
# (slurmctld + slurmd on this machine) with its own slurm.conf, spool, state and munge socket in
# a temporary folder (SLURM_CONF points there; nothing is written under /etc). The script is
# submitted with sbatch for one node and the built binaries; the test checks that Slurm ran it to
# completion, that the moectl job result says SUCCEEDED with verify passed, that the
# agent and the daemon exited cleanly at the teardown and that the agent's file_sd file lists
# both; then stops munged, slurmd and slurmctld by their pids.
# Skips where the packages cannot be installed or slurmd does not come up idle within 30 s.
# usage: slurm_test.sh MOED MOE_AGENT MOECTL
set -euo pipefail
source "$(dirname "$0")/lib.sh"
moed=$(realpath "${1:?usage: slurm_test.sh MOED MOE_AGENT MOECTL}")
agent=$(realpath "${2:?}")
moectl=$(realpath "${3:?}")
[ "$(id -u)" -eq 0 ] || skip "slurmd runs jobs as root here; run as root"
need_packages slurm-wlm munge
make_tmp
chmod 0755 "$TMP" # munged (its own user) reaches its socket folder through it
cleanup() {
  local f
  for f in "$TMP/slurm/slurmd.pid" "$TMP/slurm/slurmctld.pid" "$TMP/munge-run/munged.pid"; do
    if [ -s "$f" ]; then kill "$(cat "$f")" 2>/dev/null || true; fi
  done
  # Wait (at most 10 s) for them to go before removing their folders.
  for _ in $(seq 100); do
    local up=""
    for f in "$TMP/slurm/slurmd.pid" "$TMP/slurm/slurmctld.pid" "$TMP/munge-run/munged.pid"; do
      [ -s "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && up=yes
    done
    [ -z "$up" ] && break
    sleep 0.1 # polling for the daemons to exit
  done
  cleanup_tmp
}
trap cleanup EXIT

# munge: its own key, socket, log and seed; run as the munge user, as Debian does.
mkdir -p "$TMP/munge" "$TMP/munge-run"
chmod 0700 "$TMP/munge"
chmod 0755 "$TMP/munge-run"
mungekey --create --keyfile="$TMP/munge/munge.key" >/dev/null 2>&1 ||
  dd if=/dev/urandom of="$TMP/munge/munge.key" bs=1024 count=1 status=none
chmod 0600 "$TMP/munge/munge.key"
chown -R munge:munge "$TMP/munge" "$TMP/munge-run"
socket=$TMP/munge-run/munge.sock
su -s /bin/sh munge -c "munged --socket='$socket' --key-file='$TMP/munge/munge.key' \
  --log-file='$TMP/munge/munged.log' --pid-file='$TMP/munge-run/munged.pid' \
  --seed-file='$TMP/munge/munged.seed'" || { cat "$TMP/munge/munged.log" >&2; fail "munged did not start"; }

# Two free TCP ports for slurmctld and slurmd.
read -r ctld_port slurmd_port < <(/usr/bin/python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')
host=$(hostname -s)
mkdir -p "$TMP/slurm/state" "$TMP/slurm/spool"
cat >"$TMP/slurm/slurm.conf" <<CONF
ClusterName=moedtest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation=$TMP/slurm/state
SlurmdSpoolDir=$TMP/slurm/spool
SlurmctldPidFile=$TMP/slurm/slurmctld.pid
SlurmdPidFile=$TMP/slurm/slurmd.pid
SlurmctldLogFile=$TMP/slurm/slurmctld.log
SlurmdLogFile=$TMP/slurm/slurmd.log
ReturnToService=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=$(nproc) State=UNKNOWN
PartitionName=moedtest Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
echo "CgroupPlugin=autodetect" >"$TMP/slurm/cgroup.conf"
export SLURM_CONF=$TMP/slurm/slurm.conf

slurmctld || { cat "$TMP/slurm/slurmctld.log" >&2; fail "slurmctld did not start"; }
slurmd -N "$host" || { cat "$TMP/slurm/slurmd.log" >&2; fail "slurmd did not start"; }
state=""
for _ in $(seq 300); do
  state=$(sinfo -h -N -n "$host" -o %t 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 0.1 # polling sinfo until the node is idle
done
if [ "$state" != idle ]; then
  tail -n 5 "$TMP/slurm/slurmctld.log" "$TMP/slurm/slurmd.log" >&2 || true
  skip "slurmd did not come up idle within 30 s (node state: ${state:-none})"
fi
log "Slurm $(sinfo -V | awk '{print $2}') up: node $host idle"

# The binaries where MOE_BIN points, as an installation would have them.
mkdir -p "$TMP/bin" "$TMP/run"
ln -s "$moed" "$TMP/bin/moed"
ln -s "$agent" "$TMP/bin/moe-agent"
ln -s "$moectl" "$TMP/bin/moectl"
# The script as shipped, less the flags the binaries do not accept yet (MOE_PENDING_FLAGS).
cp "$MOE_SRC/deploy/slurm/moed.sbatch" "$TMP/moed.sbatch"
for name in moe-agent moed; do
  pending_out=$(pending_flags "$name" "$TMP/bin/$name")
  read -r -d '' -a pending <<<"$pending_out" || true
  for flag in "${pending[@]}"; do
    sed -i -E "s/[[:space:]]${flag}[= ](\"[^\"]*\"|[^[:space:]]*)//g" "$TMP/moed.sbatch"
  done
done
job=$(MOE_BIN=$TMP/bin MOE_RUN_DIR=$TMP/run MOE_BACKEND=cpu \
  sbatch --parsable --nodes=1 --exclusive --time=5 --chdir="$TMP/run" --output="$TMP/run/slurm-%j.out" \
  "$TMP/moed.sbatch")
log "submitted Slurm job $job"
done_state=""
for _ in $(seq 900); do
  done_state=$(scontrol show job "$job" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p')
  case $done_state in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE) break ;; esac
  sleep 0.1 # polling Slurm for the job's end
done
echo "--- slurm-$job.out"
cat "$TMP/run/slurm-$job.out" || true
[ "$done_state" = COMPLETED ] || {
  tail -n 20 "$TMP/run/logs/"*.log >&2 || true
  fail "Slurm job $job ended $done_state (expected COMPLETED)"
}
[ -s "$TMP/run/result.json" ] || fail "the script left no result.json"
/usr/bin/python3 - "$TMP/run/result.json" <<'PY' || fail "the moectl job result is not SUCCEEDED: $(cat "$TMP/run/result.json")"
import json, sys
r = json.load(open(sys.argv[1]))
print("job", r.get("job_id"), r.get("state"), "steps", r.get("steps_completed"), "verify passed:", r.get("verify", {}).get("passed"))
sys.exit(0 if r.get("state") == "SUCCEEDED" and r.get("verify", {}).get("passed") else 1)
PY
grep -q "cluster torn down cleanly" "$TMP/run/slurm-$job.out" ||
  fail "the agent and the daemons did not all exit 0 on SIGTERM"
/usr/bin/python3 - "$TMP/run/prometheus/targets.json" <<'PY' || fail "no file_sd targets for the agent and the daemon in MOE_RUN_DIR/prometheus/targets.json"
import json, sys
groups = json.load(open(sys.argv[1]))
sys.exit(0 if {"agent", "moed"} <= {g["labels"]["role"] for g in groups if g.get("targets")} else 1)
PY
echo "ok: moed.sbatch ran a verified job on Slurm and tore the cluster down"
