#!/usr/bin/env python3
"""Elastic recovery against a checkpoint restart (docs/jobs.md#elastic-jobs).

On a local 2x2 cluster, the same train job (E=16, K=4, zipf, Adam) is interrupted by a SIGKILL of
node1 mid-job, N times each way:
  elastic  --elastic --min-node-replicas 2: the job goes on on node0 (node1 restarted after, for
           the next round);
  restart  checkpoints every 10 steps, no --elastic: the job fails, node1 is restarted
           (moectl node restart) and the job resubmitted with --resume.
Per kill it measures the wall time lost (the kill to the moment the job has again completed the
step that was in flight when it died) and the steps recomputed; prints the median and max of each.

usage: elastic_bench.py [--bin-dir BUILD] [--kills N] [--steps S] [--at A]
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time

JOB = ["--mode", "train", "--experts", "16", "--top-k", "4", "--hidden", "256", "--ffn-hidden", "256",
       "--tokens-per-rank", "256", "--skew", "zipf:1.2", "--seed", "7", "--dead-node-timeout-ms", "1000"]


class Cluster:
    def __init__(self, bin_dir):
        self.moectl = os.path.join(bin_dir, "cli", "moectl")
        self.state = tempfile.mkdtemp(prefix="moe-elastic-bench.")

    def ctl(self, *args, check=True):
        p = subprocess.run([self.moectl, "--state-dir", self.state, *args], capture_output=True, text=True, timeout=180)
        if check and p.returncode != 0:
            raise SystemExit("moectl %s: %s" % (" ".join(args), p.stdout + p.stderr))
        return p.stdout

    def json(self, *args):
        out = self.ctl("--output", "json", *args, check=False)
        return json.loads(out[out.find("{"):]) if "{" in out else {}

    def step(self, job):
        return int(self.json("job", "status", job).get("progress", {}).get("step", 0))

    def kill_node1(self):
        with open(os.path.join(self.state, "pids", "node1.pid")) as f:
            os.kill(int(f.read().strip()), signal.SIGKILL)

    def down(self):
        self.ctl("cluster", "down", check=False)
        shutil.rmtree(self.state, ignore_errors=True)


def wait_step(c, job, past, deadline=120):
    """Seconds until job's progress passed step `past` (polled every 10 ms)."""
    start = time.time()
    while c.step(job) <= past:
        if time.time() - start > deadline:
            raise SystemExit("job %s did not pass step %d in %d s" % (job, past, deadline))
        time.sleep(0.01)  # polling the agent for the job's progress
    return time.time()


def submit(c, *extra):
    return c.ctl("job", "submit", *JOB, *extra).strip().splitlines()[0]


def elastic_round(c, steps, at):
    job = submit(c, "--steps", str(steps), "--elastic", "--min-node-replicas", "2")
    wait_step(c, job, at - 1)
    s = c.step(job)
    c.kill_node1()
    killed = time.time()
    back = wait_step(c, job, s)
    r = c.json("job", "wait", job)
    assert r.get("state") == "SUCCEEDED", r.get("message")
    w = r["world_changes"][0]
    c.ctl("node", "restart", "node1")
    return back - killed, int(w.get("steps_recomputed", 0)), w.get("detection_seconds", 0), w.get("recovery_seconds", 0)


def restart_round(c, steps, at, ckpt):
    shutil.rmtree(ckpt, ignore_errors=True)
    job = submit(c, "--steps", str(steps), "--checkpoint-dir", ckpt, "--checkpoint-every", "10")
    wait_step(c, job, at - 1)
    s = c.step(job)
    c.kill_node1()
    killed = time.time()
    c.ctl("job", "wait", job, check=False)  # FAILED, naming node1
    c.ctl("node", "restart", "node1")
    first = int(c.json("checkpoint", "show", ckpt).get("step", 0))  # the latest complete checkpoint
    resumed = c.ctl("job", "submit", "--resume", ckpt, "--steps", str(steps)).strip().splitlines()[0]
    back = wait_step(c, resumed, s)
    r = c.json("job", "wait", resumed)
    assert r.get("state") == "SUCCEEDED", r.get("message")
    return back - killed, s - first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "build"))
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--at", type=int, default=35)
    a = ap.parse_args()
    c = Cluster(a.bin_dir)
    try:
        c.ctl("cluster", "up", "--nodes", "2", "--devices-per-node", "2")
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
        print("2x2 local cluster on %s (%d cores); job: %s, %d steps, node1 SIGKILLed at step ~%d"
              % (cpu, os.cpu_count(), " ".join(JOB), a.steps, a.at))
        elastic = [elastic_round(c, a.steps, a.at) for _ in range(a.kills)]
        restart = [restart_round(c, a.steps, a.at, os.path.join(c.state, "ckpt")) for _ in range(a.kills)]
    finally:
        c.down()
    med = statistics.median
    print("%-22s %10s %10s %12s %12s" % ("", "lost p50 s", "lost max s", "recomputed", "kills"))
    print("%-22s %10.2f %10.2f %12s %12d" % ("elastic (replicas)", med(e[0] for e in elastic),
                                              max(e[0] for e in elastic),
                                              "%d-%d" % (min(e[1] for e in elastic), max(e[1] for e in elastic)), a.kills))
    print("%-22s %10.2f %10.2f %12s %12d" % ("restart (checkpoint)", med(r[0] for r in restart),
                                              max(r[0] for r in restart),
                                              "%d-%d" % (min(r[1] for r in restart), max(r[1] for r in restart)), a.kills))
    print("elastic detection p50 %.2f s (max %.2f), recovery p50 %.2f s (max %.2f)"
          % (med(e[2] for e in elastic), max(e[2] for e in elastic), med(e[3] for e in elastic),
             max(e[3] for e in elastic)))


if __name__ == "__main__":
    main()
