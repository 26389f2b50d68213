#!/usr/bin/env python3
"""The thrash harness (docs/architecture.md#thrashing): small jobs on a local 2x2
cluster, each with a random fault, and the cluster's invariants checked after each.

usage: thrash.py --bin-dir BUILD [--iterations N] [--seed S] [--work DIR] [--json FILE]

Faults, one per iteration, chosen at random (seeded):
  none             the control: the job must succeed
  kill_daemon      SIGKILL of a daemon mid-job, restarted with its command line
  restart_daemon   SIGKILL of a daemon mid-job, restarted at once (within the heartbeat timeout): the job
                   must end within 20 s
  stop_daemon      SIGSTOP of a daemon mid-job for 1-4 s, then SIGCONT
  kill_agent       SIGKILL of the agent mid-job, restarted from agent.argv (within its grace)
  bad_frames       garbage, a truncated frame and an oversized length into every port
  rebalance        a live rebalance of the running job (moectl placement rebalance)
  checkpoint_gone  the job's checkpoint folder removed mid-job
  checkpoint_full  the job's checkpoints on a 192 KiB tmpfs (root; otherwise skipped)
  slow_link        loopback shaped for 1-4 s: every packet delayed 2-10 ms at 100 Mbit/s-1 Gbit/s
                   (tc netem), or where the kernel has no netem, rate-limited to 10-100 Mbit/s
                   (tc tbf); root and tc, otherwise skipped. The daemons talk UCX over TCP
                   (UCX_TLS=tcp), so the data plane crosses the slow link too.

Some jobs (two in five) are elastic (docs/jobs.md#elastic-jobs: --elastic, every expert on both
nodes, a 1 s dead-node timeout): a node lost goes on without it, a node back joins it.

After each iteration (violations, each named):
  - the job reached an end state within its deadline, and one that is not SUCCEEDED has a
    message; jobs under `none`, `bad_frames`, `rebalance` and `slow_link` succeed, and elastic
    ones under `kill_daemon`, `restart_daemon` and `stop_daemon` too;
  - every process is alive again and every node ALIVE within 30 s;
  - the history is intact: `job list` holds every job submitted so far, each ended;
  - `placement show` answers;
  - every checkpoint the job committed (a step folder with checkpoint.json) passes
    `moectl checkpoint show`, and the latest one resumes into a job that succeeds.
Prints one line per iteration and a summary:
  thrash: N iterations, faults: KIND=n ..., violations: V
and "N passed, M failed" (iterations without and with a violation); exit 1 on any violation.
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

JOB_DEADLINE = 120  # seconds from submit to an end state
RECOVER_DEADLINE = 30
ENDED = ("SUCCEEDED", "FAILED", "CANCELLED")
FAULTS = ["none", "kill_daemon", "restart_daemon", "stop_daemon", "kill_agent", "bad_frames", "rebalance",
          "checkpoint_gone", "checkpoint_full", "slow_link"]
RESTART_DEADLINE = 20  # seconds from a daemon's SIGKILL-and-restart to its job's end (it hung 44-46 s before)
MUST_SUCCEED = {"none", "bad_frames", "rebalance", "slow_link"}
ELASTIC_MUST_SUCCEED = MUST_SUCCEED | {"kill_daemon", "restart_daemon", "stop_daemon"}
ELASTIC = ["--elastic", "--min-node-replicas", "2", "--dead-node-timeout-ms", "1000"]
SHAPE_HANDLE = "7e57:"  # the harness's netem qdisc on lo, and only that one is ever removed


class Harness:
    def __init__(self, args):
        self.bin = args.bin_dir
        self.work = args.work
        self.state = os.path.join(self.work, "state")
        self.rng = random.Random(args.seed)
        self.jobs = []  # every job id submitted
        self.violations = []  # (iteration, text)
        self.faults = {}
        self.skipped = {}
        self.mounts = []

    # --- processes -------------------------------------------------------------------
    def ctl(self, *args, timeout=60):
        cmd = [os.path.join(self.bin, "cli", "moectl"), "--state-dir", self.state, *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr

    def ctl_json(self, *args, timeout=60):
        rc, out = self.ctl("--output", "json", *args, timeout=timeout)
        start = out.find("{")
        try:
            return rc, json.loads(out[start:]) if start >= 0 else {}
        except json.JSONDecodeError:
            return rc, {}

    def pid_of(self, name):
        try:
            with open(os.path.join(self.state, "pids", name + ".pid")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return -1

    @staticmethod
    def alive(pid):
        if pid <= 0:
            return False
        try:
            with open("/proc/%d/stat" % pid) as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    @staticmethod
    def cmdline(pid):
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]

    def spawn(self, name, argv):
        """Starts a process as `cluster up` does (own session, log appended, pid file)."""
        log = open(os.path.join(self.state, "logs", name + ".log"), "ab")
        p = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        with open(os.path.join(self.state, "pids", name + ".pid"), "w") as f:
            f.write("%d\n" % p.pid)
        return p

    def restart_agent(self):
        with open(os.path.join(self.state, "agent.argv")) as f:
            argv = [l for l in f.read().split("\n") if l]
        self.spawn("agent", argv)

    # --- the cluster ------------------------------------------------------------------
    def up(self):
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work)
        self.unshape()  # a run killed mid-fault may have left lo shaped
        os.environ["UCX_TLS"] = "tcp"  # between the daemons, over loopback: what slow_link shapes
        rc, out = self.ctl("cluster", "up", "--nodes", "2", "--devices-per-node", "2", "--backend", "cpu",
                           "--agent-grace", "20", "--rebalance-timeout-ms", "20000", timeout=120)
        if rc != 0:
            sys.exit("thrash: cluster up failed (%d): %s" % (rc, out))

    def down(self):
        self.unshape()
        self.ctl("cluster", "down", timeout=60)
        for m in self.mounts:
            subprocess.run(["umount", "-l", m], capture_output=True)

    def nodes_alive(self):
        rc, st = self.ctl_json("cluster", "status", timeout=10)
        nodes = st.get("nodes", [])
        return rc == 0 and len(nodes) == 2 and all(str(n.get("state", "")).endswith("ALIVE") for n in nodes)

    # --- one job ---------------------------------------------------------------------
    def job_spec(self, train, elastic):
        """A small job's spec flags (what a resume must repeat)."""
        spec = ["--experts", "8", "--top-k", "2", "--hidden", "32", "--ffn-hidden", "32", "--tokens-per-rank", "256",
                "--skew", "zipf:1.2", "--seed", str(self.rng.randrange(1 << 30))]
        return spec + (["--mode", "train"] if train else []) + (ELASTIC if elastic else [])

    def submit(self, spec, steps, ckpt_dir):
        args = ["job", "submit", *spec, "--steps", str(steps)]
        if ckpt_dir:
            args += ["--checkpoint-dir", ckpt_dir, "--checkpoint-every", "10"]
        rc, out = self.ctl(*args)
        m = re.search(r"^(job-[0-9]+)$", out, re.M) if rc == 0 else None  # stdout's line, whatever stderr says
        job = m.group(1) if m else ""
        return rc, job, out

    def state_of(self, job):
        rc, r = self.ctl_json("job", "status", job, timeout=10)
        return str(r.get("state", "")), r

    def wait_steps(self, job, steps, deadline):
        """Until the job has completed `steps` steps or ended; False at the deadline."""
        while time.time() < deadline:
            state, r = self.state_of(job)
            if state.endswith(ENDED) or float(r.get("steps_completed", 0)) >= steps:
                return True
            time.sleep(0.05)  # polling another process's progress
        return False

    def wait_end(self, job, deadline):
        while time.time() < deadline:
            state, r = self.state_of(job)
            if state.endswith(ENDED):
                return state, r
            time.sleep(0.1)  # polling another process's progress
        return None, None

    # --- faults ------------------------------------------------------------------------
    def control_address(self, name):
        rc, st = self.ctl_json("cluster", "status", timeout=10)
        return next((n.get("control_address", "") for n in st.get("nodes", []) if n.get("name") == name), "")

    def fault_kill_daemon(self, job, ctx):
        name = self.rng.choice(["node0", "node1"])
        pid = self.pid_of(name)
        argv = self.cmdline(pid)
        old = self.control_address(name)
        os.kill(pid, signal.SIGKILL)
        while self.alive(pid):
            time.sleep(0.01)  # waiting for the kernel to reap it
        ctx["restart"] = lambda: self.spawn(name, argv)
        # Until the restarted daemon registered (a new control address), the agent may
        # still count the dead one as alive (restart_daemon restarts it at once).
        ctx["reregistered"] = lambda: self.control_address(name) not in ("", old)

    def fault_restart_daemon(self, job, ctx):
        """SIGKILL a daemon and start it again at once, within the heartbeat timeout: its new
        registration must end the job promptly (docs/jobs.md#a-node-restarts)."""
        name = self.rng.choice(["node0", "node1"])
        pid = self.pid_of(name)
        argv = self.cmdline(pid)
        os.kill(pid, signal.SIGKILL)
        while self.alive(pid):
            time.sleep(0.01)  # waiting for the kernel to reap it
        self.spawn(name, argv)
        ctx["end_by"] = time.time() + RESTART_DEADLINE
        ctx["node"] = name

    def fault_stop_daemon(self, job, ctx):
        pid = self.pid_of(self.rng.choice(["node0", "node1"]))
        os.kill(pid, signal.SIGSTOP)
        time.sleep(self.rng.uniform(1, 4))  # the fault itself: a node silent for a while
        os.kill(pid, signal.SIGCONT)

    def fault_kill_agent(self, job, ctx):
        pid = self.pid_of("agent")
        os.kill(pid, signal.SIGKILL)
        while self.alive(pid):
            time.sleep(0.01)
        time.sleep(self.rng.uniform(0, 2))  # the agent away for a while
        self.restart_agent()

    def fault_bad_frames(self, job, ctx):
        rc, st = self.ctl_json("cluster", "status", timeout=10)
        addrs = [st.get("agent_address", "")] + [n.get("control_address", "") for n in st.get("nodes", [])]
        addrs += [st.get("agent_metrics_address", "")] + [n.get("metrics_address", "") for n in st.get("nodes", [])]
        payloads = [os.urandom(self.rng.randrange(1, 512)), struct.pack(">I", 0xFFFFFFF0) + b"x" * 64,
                    struct.pack(">I", 100) + b"\x0a\x05", b"GET /" + b"A" * 70000 + b" HTTP/1.1\r\n\r\n"]
        for a in addrs:
            if ":" not in a:
                continue
            host, port = a.rsplit(":", 1)
            for p in payloads:
                try:
                    with socket.create_connection(("127.0.0.1" if host in ("0.0.0.0", "") else host, int(port)),
                                                  timeout=2) as s:
                        s.sendall(p)
                        s.settimeout(0.5)
                        try:
                            s.recv(4096)
                        except OSError:
                            pass
                except OSError:
                    pass

    def fault_rebalance(self, job, ctx):
        rc, out = self.ctl("placement", "rebalance", "--redundant-experts", self.rng.choice(["0", "4"]), timeout=90)
        ctx["note"] = "rebalance exit %d" % rc

    def fault_checkpoint_gone(self, job, ctx):
        shutil.rmtree(ctx["ckpt"], ignore_errors=True)

    def can_shape(self):
        return self.shaper() is not None

    def shaper(self):
        """The qdisc this kernel has for a slow link: "netem", "tbf" or None (probed once)."""
        if not hasattr(self, "_shaper"):
            self._shaper = None
            if os.geteuid() == 0 and shutil.which("tc"):
                for kind, args in (("netem", ["netem", "delay", "1ms"]), ("tbf", ["tbf", "rate", "1gbit", "burst", "64kb",
                                                                                  "latency", "50ms"])):
                    add = ["tc", "qdisc", "add", "dev", "lo", "root", "handle", SHAPE_HANDLE] + args
                    if subprocess.run(add, capture_output=True).returncode == 0:
                        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root", "handle", SHAPE_HANDLE],
                                       capture_output=True)
                        self._shaper = kind
                        break
        return self._shaper

    def unshape(self):
        if not self.can_shape():
            return
        out = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
        if " " + SHAPE_HANDLE + " root" in out:
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root", "handle", SHAPE_HANDLE], capture_output=True)

    def fault_slow_link(self, job, ctx):
        if self.shaper() == "netem":
            how = ["netem", "delay", self.rng.choice(["2ms", "5ms", "10ms"]), "rate", self.rng.choice(["100mbit", "1gbit"])]
        else:
            how = ["tbf", "rate", self.rng.choice(["10mbit", "100mbit"]), "burst", "32kb", "latency", "100ms"]
        r = subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "handle", SHAPE_HANDLE] + how,
                           capture_output=True, text=True)
        if r.returncode != 0:  # probed at the start, so a harness fault: say so
            self.violate(ctx["it"], "tc refused the slow link (%s): %s" % (" ".join(how), r.stderr.strip()))
            return
        print("  lo shaped: " + " ".join(how), flush=True)
        try:
            time.sleep(self.rng.uniform(1, 4))  # the fault itself: a slow link for a while
        finally:
            self.unshape()

    # --- one iteration -------------------------------------------------------------------
    def violate(self, it, text):
        self.violations.append((it, text))
        print("  VIOLATION: " + text, flush=True)

    def iteration(self, it):
        fault = self.rng.choice(FAULTS)
        train = fault in ("checkpoint_gone", "checkpoint_full") or self.rng.random() < 0.5
        ckpt = None
        if train and (fault.startswith("checkpoint") or self.rng.random() < 0.3):
            ckpt = os.path.join(self.work, "ckpt-%d" % it)
            os.makedirs(ckpt)
            if fault == "checkpoint_full":
                if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", ckpt],
                                                       capture_output=True).returncode != 0:
                    self.skipped[fault] = self.skipped.get(fault, 0) + 1
                    fault = "none"
                else:
                    self.mounts.append(ckpt)
        if fault == "slow_link" and not self.can_shape():
            self.skipped[fault] = self.skipped.get(fault, 0) + 1
            fault = "none"
        self.faults[fault] = self.faults.get(fault, 0) + 1
        steps = self.rng.randrange(40, 160)
        elastic = self.rng.random() < 0.4
        spec = self.job_spec(train, elastic)
        rc, job, out = self.submit(spec, steps, ckpt)
        print("iteration %d: %s, %s%s job %s, %d steps%s" % (it, fault, "elastic " if elastic else "",
                                                              "train" if train else "forward", job or "?", steps,
                                                              ", checkpoints" if ckpt else ""), flush=True)
        if rc != 0 or not job:
            self.violate(it, "submit failed (%d): %s" % (rc, out.strip()))
            return
        self.jobs.append(job)
        start = time.time()
        ctx = {"ckpt": ckpt, "it": it}
        if fault != "none" and self.wait_steps(job, self.rng.randrange(1, 20), start + JOB_DEADLINE):
            getattr(self, "fault_" + fault, lambda j, c: None)(job, ctx)
        state, r = self.wait_end(job, start + JOB_DEADLINE)
        if "end_by" in ctx and state is not None and not state.endswith("SUCCEEDED") and time.time() > ctx["end_by"]:
            self.violate(it, "job %s ended more than %d s after %s restarted" % (job, RESTART_DEADLINE, ctx["node"]))
        if "restart" in ctx:
            ctx["restart"]()
        if state is None:
            self.violate(it, "job %s did not end within %d s" % (job, JOB_DEADLINE))
            self.ctl("job", "cancel", job)
        else:
            message = r.get("message", "")
            print("  %s in %.1f s%s" % (state, time.time() - start, ": " + message[:160] if message else ""),
                  flush=True)
            if not state.endswith("SUCCEEDED") and not message:
                self.violate(it, "job %s ended %s without a reason" % (job, state))
            if fault in (ELASTIC_MUST_SUCCEED if elastic else MUST_SUCCEED) and not state.endswith("SUCCEEDED"):
                self.violate(it, "%sjob %s under %s ended %s: %s" % ("elastic " if elastic else "", job, fault, state,
                                                                   message))
            changes = r.get("world_changes", [])
            if changes:
                print("  world changes: " + "; ".join("%s at step %s, %s -> %s ranks" % (
                    w.get("kind"), w.get("step", 0), w.get("old_world"), w.get("new_world")) for w in changes),
                      flush=True)
        self.check_cluster(it, ctx)
        if ckpt and fault != "checkpoint_gone":
            self.check_checkpoints(it, ckpt, spec)

    def check_cluster(self, it, ctx):
        deadline = time.time() + RECOVER_DEADLINE
        back = ctx.get("reregistered", lambda: True)
        while time.time() < deadline and not (self.alive(self.pid_of("agent")) and self.nodes_alive() and back()):
            time.sleep(0.1)  # polling the nodes' return
        if not back():
            self.violate(it, "the restarted daemon did not register within %d s" % RECOVER_DEADLINE)
        for name in ("agent", "node0", "node1"):
            if not self.alive(self.pid_of(name)):
                self.violate(it, name + " is not running")
        if not self.nodes_alive():
            self.violate(it, "not every node ALIVE within %d s" % RECOVER_DEADLINE)
        rc, listing = self.ctl_json("job", "list", timeout=10)
        listed = {j.get("job_id"): str(j.get("state", "")) for j in listing.get("jobs", [])}
        for job in self.jobs:
            if job not in listed:
                self.violate(it, "job %s is missing from the history" % job)
            elif not listed[job].endswith(ENDED):
                self.violate(it, "job %s is still %s" % (job, listed[job]))
        rc, out = self.ctl("placement", "show", timeout=10)
        if rc != 0:
            self.violate(it, "placement show exits %d: %s" % (rc, out.strip()[:200]))

    def check_checkpoints(self, it, ckpt, spec):
        complete = sorted(d for d in os.listdir(ckpt)
                          if d.startswith("step-") and os.path.exists(os.path.join(ckpt, d, "checkpoint.json")))
        for d in complete:
            rc, out = self.ctl("checkpoint", "show", os.path.join(ckpt, d), timeout=30)
            if rc != 0:
                self.violate(it, "committed checkpoint %s does not show (%d): %s" % (d, rc, out.strip()[:200]))
        if not complete:
            return
        # The latest committed checkpoint resumes: two more steps from it.
        done = int(complete[-1][len("step-"):])
        rc, out = self.ctl("job", "submit", *spec, "--resume", os.path.join(ckpt, complete[-1]),
                           "--steps", str(done + 2), "--wait", timeout=JOB_DEADLINE)
        words = out.strip().split()
        if words and words[0].startswith("job-"):
            self.jobs.append(words[0])
        if rc != 0:
            self.violate(it, "resuming %s failed (%d): %s" % (complete[-1], rc, out.strip()[:300]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", required=True, help="the build folder (cli/moectl, daemon/moed, agent/moe-agent)")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", default="/tmp/moe-thrash-%d" % os.getpid())
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    h = Harness(args)
    h.up()
    t0 = time.time()
    try:
        for it in range(args.iterations):
            h.iteration(it)
    finally:
        h.down()
    bad = {it for it, _ in h.violations}
    faults = " ".join("%s=%d" % (k, h.faults.get(k, 0)) for k in FAULTS)
    skipped = " ".join("%s=%d" % kv for kv in sorted(h.skipped.items()))
    print("thrash: %d iterations in %.0f s, faults: %s%s, violations: %d" %
          (args.iterations, time.time() - t0, faults, " (skipped: %s)" % skipped if skipped else "",
           len(h.violations)))
    for it, text in h.violations:
        print("  iteration %d: %s" % (it, text))
    print("%d passed, %d failed" % (args.iterations - len(bad), len(bad)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"iterations": args.iterations, "seconds": time.time() - t0, "faults": h.faults,
                       "skipped": h.skipped, "violations": [{"iteration": i, "what": t} for i, t in h.violations]},
                      f, indent=1)
    return 1 if h.violations else 0


if __name__ == "__main__":
    sys.exit(main())
