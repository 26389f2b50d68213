#!/usr/bin/env python3
"""The layer rules (docs/architecture.md#layers-and-libraries), checked on the code
and on the build's link graph, so a rule broken later fails CI.

1. Includes: every source folder may include only the library roots
   (`#include "moe/<root>/..."`) that its layer allows.
2. Links: in the build's link graph (CMake's file API, written by the top
   CMakeLists), no project target reaches a library its layer forbids, directly
   or through another library.

Usage: layer_rules.py SOURCE_DIR BUILD_DIR [CMAKE]. Prints each broken rule; exit 1 if any.
CMake answers the file API query the top CMakeLists writes only from the second
configure of a build folder on; after the first, this re-runs CMAKE on it (0.3 s).
"""
import json
import os
import re
import subprocess
import sys

# Include roots a folder's sources may use. The first matching prefix wins, so
# list deeper folders before their parents. tests/ may include anything.
ALLOWED_INCLUDES = [
    ("base/map/", {"base", "map"}),
    ("base/", {"base"}),
    # The tensor wire knows base only: the client and the daemon both use it.
    ("proto/tensor_wire/", {"base", "tensor_wire"}),
    ("kernels/", {"base", "kernels", "ref"}),
    ("proto/", {"base", "map", "v1", "rpc", "spec", "http"}),
    ("daemon/model/", {"base", "kernels", "model"}),
    ("daemon/transport/", {"base", "transport"}),
    ("daemon/io/", {"base", "kernels", "model", "io"}),
    ("daemon/layer_spec/", {"base", "kernels", "model", "io", "v1", "layer_spec"}),
    ("daemon/ep/", {"base", "map", "kernels", "ref", "model", "layer_spec", "transport", "ep"}),
    ("daemon/metrics/", {"base", "http", "metrics"}),
    # The serving benchmark is a client of a serving job beside the in-process layer.
    ("daemon/bench/serve_bench.cc", {"base", "kernels", "model", "layer_spec", "ep", "client", "v1", "rpc"}),
    ("daemon/", {"base", "map", "kernels", "ref", "model", "layer_spec", "transport", "io", "ep", "metrics", "node",
                 "v1", "rpc", "spec", "http", "tensor_wire"}),
    # moe-placement-sim reads a serving job's routing traces (safetensors).
    ("agent/placement/sim_main.cc", {"base", "map", "placement", "io"}),
    ("agent/placement/", {"base", "map", "placement"}),
    # The agent's rooms, each above the ones before it (agent/CMakeLists.txt).
    ("agent/cluster/", {"base", "map", "placement", "cluster", "v1", "rpc", "spec"}),
    ("agent/jobs/", {"base", "map", "placement", "cluster", "jobs", "v1", "rpc", "spec"}),
    ("agent/rebalance/", {"base", "map", "placement", "cluster", "jobs", "rebalance", "v1", "rpc"}),
    ("agent/serve/", {"base", "map", "placement", "cluster", "jobs", "rebalance", "agent", "v1", "rpc", "spec",
                      "http"}),
    ("cli/", {"base", "map", "ctl", "v1", "rpc", "spec"}),
    ("client/", {"base", "client", "v1", "rpc", "tensor_wire"}),
    ("python/", {"base", "client", "v1", "rpc"}),
]

# Project libraries each group of targets must never reach in the link graph.
KERNELS = {"moe_kernels_api", "moe_kernels_cpu", "moe_kernels_cuda", "moe_kernels_ref"}
DAEMON = {"moe_model", "moe_layer_spec", "moe_job_layers", "moe_layer", "moe_io", "moe_transport",
          "moe_transport_nccl", "moe_transport_factory", "moe_ep", "moe_metrics", "moe_node"}
TRANSPORT = {"moe_transport", "moe_transport_nccl", "moe_transport_factory"}
CONTROL = {"moe_proto", "moe_rpc", "moe_rpc_server", "moe_spec", "moe_metrics_http"}
WIRE = {"moe_tensor_wire"}
AGENT = {"moe_agent_lib", "moe_agent_rebalance", "moe_agent_jobs", "moe_agent_cluster", "moe_placement"}
CLI = {"moe_ctl"}
CLIENT = {"moe_client"}
PYTHON = {"moed_client_module"}
FORBIDDEN_LINKS = [
    # (what the rule is, targets it applies to, libraries they must not reach)
    ("base links nothing of the project above it", {"moe_base", "moe_map"},
     KERNELS | DAEMON | CONTROL | AGENT | CLI),
    ("kernels never reach the daemon, the control plane, the agent or the CLI", KERNELS,
     DAEMON | CONTROL | AGENT | CLI),
    ("the control-plane libraries never reach kernels, daemon, agent or CLI", CONTROL,
     KERNELS | DAEMON | AGENT | CLI),
    ("the agent never links kernels or a transport (nor the daemon or the CLI)",
     AGENT | {"moe-agent"}, KERNELS | DAEMON | TRANSPORT | CLI),
    ("the placement solver is pure: no control plane either", {"moe_placement", "moe-placement-sim"},
     CONTROL),
    ("the agent's rooms link only the rooms below them: cluster state below the jobs, the jobs below "
     "rebalancing, all below the service", {"moe_agent_cluster"},
     {"moe_agent_jobs", "moe_agent_rebalance", "moe_agent_lib", "moe_rpc_server", "moe_metrics_http"}),
    ("... the jobs", {"moe_agent_jobs"}, {"moe_agent_rebalance", "moe_agent_lib", "moe_rpc_server", "moe_metrics_http"}),
    ("... rebalancing", {"moe_agent_rebalance"}, {"moe_agent_lib", "moe_rpc_server", "moe_metrics_http"}),
    ("the CLI links only the control plane's client side", CLI | {"moectl"},
     KERNELS | DAEMON | AGENT | {"moe_rpc_server", "moe_metrics_http"}),
    ("the spec library needs no RPC", {"moe_spec"}, {"moe_rpc", "moe_rpc_server"}),
    ("the tensor wire is base and UCX only: no messages, kernels, daemon, agent or CLI", WIRE,
     KERNELS | DAEMON | CONTROL | AGENT | CLI | CLIENT),
    ("the agent has no tensor wire", AGENT | {"moe-agent"} | CLI | {"moectl"}, WIRE),
    ("the expert service's client links only the control plane's client side", CLIENT,
     KERNELS | DAEMON | AGENT | CLI | {"moe_rpc_server", "moe_metrics_http", "moe_spec"}),
    ("nothing of the system links the client library", DAEMON | AGENT | CLI | {"moed", "moe-agent", "moectl"}, CLIENT),
    ("the Python package is the client library's: no kernels, daemon, agent or CLI", PYTHON,
     KERNELS | DAEMON | AGENT | CLI | {"moe_rpc_server", "moe_metrics_http", "moe_spec"}),
    ("the single-rank layer and its spec are proto-free (the device check builds them)",
     {"moe_layer_spec", "moe_layer", "moe_model"}, CONTROL | TRANSPORT | {"moe_io", "moe_job_layers"}),
    ("the daemon never links the agent or the CLI", DAEMON | {"moed"}, AGENT | CLI),
    ("transports never reach the layer, the node or the control plane", TRANSPORT,
     KERNELS | {"moe_layer", "moe_ep", "moe_node", "moe_io", "moe_model"} | CONTROL),
]

INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"moe/([A-Za-z0-9_]+)/')
SOURCE_EXT = (".h", ".cc", ".cu", ".cuh", ".cpp", ".hpp")


def include_violations(src):
    bad = []
    for top in ("base", "kernels", "proto", "daemon", "agent", "cli", "client", "python"):
        for root, _, files in os.walk(os.path.join(src, top)):
            for name in files:
                if not name.endswith(SOURCE_EXT):
                    continue
                path = os.path.join(root, name)
                rel = os.path.relpath(path, src)
                allowed = next(a for p, a in ALLOWED_INCLUDES if rel.startswith(p))
                with open(path, encoding="utf-8", errors="replace") as f:
                    for n, line in enumerate(f, 1):
                        m = INCLUDE_RE.match(line)
                        if m and m.group(1) not in allowed:
                            bad.append(f"{rel}:{n}: includes moe/{m.group(1)}/, which its layer may not use")
    return bad


def link_graph(build, cmake):
    """{target name: set of target names it depends on directly} from the file API."""
    reply = os.path.join(build, ".cmake", "api", "v1", "reply")
    if not os.path.isdir(reply):
        subprocess.run([cmake, build], check=True, stdout=subprocess.DEVNULL)
    if not os.path.isdir(reply):
        raise SystemExit(f"no CMake file API reply in {reply}: configure the build with this tree's CMakeLists")
    index = sorted(f for f in os.listdir(reply) if f.startswith("index-"))[-1]
    with open(os.path.join(reply, index)) as f:
        idx = json.load(f)
    codemodel = next(o for o in idx["objects"] if o["kind"] == "codemodel")
    with open(os.path.join(reply, codemodel["jsonFile"])) as f:
        cm = json.load(f)
    by_id, deps = {}, {}
    for t in cm["configurations"][0]["targets"]:
        with open(os.path.join(reply, t["jsonFile"])) as f:
            tj = json.load(f)
        by_id[tj["id"]] = tj["name"]
        deps[tj["name"]] = [d["id"] for d in tj.get("dependencies", [])]
    return {name: {by_id[d] for d in ids if d in by_id} for name, ids in deps.items()}


def reach(graph, start):
    seen, todo = set(), [start]
    while todo:
        for d in graph.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def link_violations(graph):
    bad = []
    for rule, targets, forbidden in FORBIDDEN_LINKS:
        for t in sorted(targets & graph.keys()):
            for f in sorted(reach(graph, t) & forbidden):
                bad.append(f"{t} reaches {f}: {rule}")
    return bad


def main():
    if len(sys.argv) not in (3, 4):
        raise SystemExit(__doc__)
    src, build = sys.argv[1], sys.argv[2]
    graph = link_graph(build, sys.argv[3] if len(sys.argv) == 4 else "cmake")
    # A rule over targets that no longer exist would guard nothing: the names must stay current.
    known = set(graph) | {"moe_kernels_cuda", "moe_transport_nccl"}  # built only with CUDA
    known |= PYTHON  # built only with MOE_PYTHON (the sanitized builds leave it out)
    stale = sorted({t for _, ts, fs in FORBIDDEN_LINKS for t in ts | fs} - known)
    bad = include_violations(src) + link_violations(graph)
    bad += [f"layer_rules.py names target {t}, which the build does not have" for t in stale]
    for line in bad:
        print(line)
    print(f"{len(graph)} targets, {len(FORBIDDEN_LINKS)} link rules, {len(ALLOWED_INCLUDES)} include rules: "
          f"{len(bad)} violations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
