#!/usr/bin/env python3
"""Queries a running Prometheus through its HTTP API (prometheus_server_test.sh).

usage:
  prometheus_server_check.py wait URL QUERY MIN SECONDS
      polls the instant QUERY until its first sample is >= MIN (exit 1 at the deadline)
  prometheus_server_check.py check URL RESULT_JSON DASHBOARD_JSON START END
      the checks after one job ran from START to END (unix seconds), RESULT_JSON
      its `moectl --output json job wait`:
      - sum over ranks of moe_expert_tokens_total per (layer, expert) equals the
        job's expert_tokens (polled: the last scrape may be a second away);
      - moe_placement_epoch of every layer went from 1 to 2 (a range query over
        the job, and changes() > 0), and the job's result ran steps under both;
      - every dashboard query returns data over the job: the variables' label
        values; each panel query with Grafana's variables substituted
        ($__rate_interval 4s and $__interval 1s for a 1 s scrape interval,
        $__range the job's span, $layer each layer, $node every node as
        Grafana's All regex) as a range query with a 1 s step (or an instant
        query at END for `instant` targets) must give at least one finite
        sample; annotations likewise, with a 1 s step. ALLOWED lists the
        queries whose series only exist under a condition this test does not
        create. The serving panels are checked by `serving`.
  prometheus_server_check.py serving URL DASHBOARD_JSON START END
      every query of the dashboard's serving panels (titles "Serving ...")
      returns data over a serving job that answered calls from START to END.
"""
import json
import math
import sys
import time
import urllib.parse
import urllib.request

# Queries that may return nothing here, and why.
ALLOWED = {
    "annotation 'Rebalance aborted or failed'":
        "only when a rebalance aborts or fails; this one commits (rebalance_test covers refused and stalled copies)",
    "annotation 'World change (elastic job lost a node)'":
        "only when an elastic job loses a node; none dies here (elastic_test kills them and reads the counter)",
}
RATE_INTERVAL = "4s"  # Grafana: max(4 x scrape interval, interval + scrape interval) at a 1 s scrape
INTERVAL = "1s"

failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL", msg, file=sys.stderr)


def api(url, path, params):
    q = urllib.parse.urlencode(params, doseq=True)
    with urllib.request.urlopen(f"{url}{path}?{q}", timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{path} {params}: {body}")
    return body["data"]


def instant(url, query, at=None):
    params = {"query": query}
    if at is not None:
        params["time"] = f"{at:.3f}"
    return api(url, "/api/v1/query", params)["result"]


def range_query(url, query, start, end, step="1s"):
    return api(url, "/api/v1/query_range",
               {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step})["result"]


def finite(v):
    return not (math.isnan(float(v)) or math.isinf(float(v)))


def has_data(result):
    for series in result:
        values = series.get("values") or [series.get("value")]
        if any(v and finite(v[1]) for v in values):
            return True
    return False


def wait(url, query, minimum, seconds):
    deadline = time.time() + float(seconds)
    last = None
    while time.time() < deadline:
        r = instant(url, query)
        last = float(r[0]["value"][1]) if r else None
        if last is not None and last >= float(minimum):
            return 0
        time.sleep(0.2)  # polling Prometheus until its scrapes show the state
    print(f"FAIL {query} stayed {last} (< {minimum}) for {seconds} s", file=sys.stderr)
    return 1


def check_expert_tokens(url, result):
    expected = {(str(l), str(e)): v for l, layer in enumerate(result["expert_tokens"])
                for e, v in enumerate(layer["tokens"])}
    if not expected or sum(expected.values()) <= 0:
        fail("the job's expert_tokens are empty")
        return
    deadline = time.time() + 15
    while True:
        got = {(s["metric"]["layer"], s["metric"]["expert"]): float(s["value"][1])
               for s in instant(url, "sum by (layer, expert) (moe_expert_tokens_total)")}
        diff = {k: (got.get(k), v) for k, v in expected.items() if abs(got.get(k, -1) - v) > 0.5}
        diff.update({k: (v, None) for k, v in got.items() if k not in expected})
        if not diff:
            print(f"ok: moe_expert_tokens_total summed over ranks = the job's expert_tokens "
                  f"({len(expected)} (layer, expert) pairs, {sum(expected.values()):.0f} pairs in all)")
            return
        if time.time() > deadline:
            fail("sum by (layer, expert) (moe_expert_tokens_total) != expert_tokens (Prometheus, job): "
                 + ", ".join(f"{k}: {v}" for k, v in sorted(diff.items())[:8]))
            return
        time.sleep(0.2)  # the last scrape after the job may not have happened yet


def check_epochs(url, result, start, end):
    layers = len(result["expert_tokens"])
    ran = [(int(e["epoch"]), int(e["steps"])) for e in result.get("epochs", [])]
    if [e for e, _ in ran] != [1, 2] or min(s for _, s in ran) <= 0:
        fail(f"the job's epochs (epoch, steps) are {ran}, not steps under 1 then under 2")
    span = int(end - start) + 5
    for layer in range(layers):
        series = range_query(url, f'moe_placement_epoch{{layer="{layer}"}}', start, end)
        values = [float(v[1]) for s in series for v in s["values"]]
        if not values or values[0] != 1 or values[-1] != 2 or values != sorted(values):
            fail(f"moe_placement_epoch{{layer=\"{layer}\"}} over the job was {sorted(set(values))} "
                 f"(first {values[:1]}, last {values[-1:]}), not 1 then 2")
            continue
        changes = instant(url, f'changes(moe_placement_epoch{{layer="{layer}"}}[{span}s])', end)
        if not changes or float(changes[0]["value"][1]) < 1:
            fail(f"changes(moe_placement_epoch{{layer=\"{layer}\"}}[{span}s]) shows no change: {changes}")
    print(f"ok: moe_placement_epoch went 1 -> 2 on {layers} layer(s); the job's (epoch, steps): {ran}")


def label_values(url, query, start, end):
    """Grafana's label_values(selector, label) through /api/v1/label/<label>/values."""
    inner = query.strip()[len("label_values("):-1]
    selector, label = inner.rsplit(",", 1)
    return api(url, f"/api/v1/label/{label.strip()}/values",
               {"match[]": selector.strip(), "start": f"{start:.3f}", "end": f"{end:.3f}"})


def substitute(expr, layer, nodes, range_s):
    out = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", INTERVAL)
    out = out.replace("$__range", f"{range_s}s").replace("${datasource}", "")
    out = out.replace("$layer", layer).replace("$node", "(" + "|".join(nodes) + ")")
    return out


def dashboard_queries(dash):
    """(where, expr, instant) for every annotation and panel target."""
    out = []
    for a in dash.get("annotations", {}).get("list", []):
        if not a.get("builtIn"):
            out.append((f"annotation {a.get('name')!r}", a["target"]["expr"], False))
    panels = []
    for p in dash.get("panels", []):
        panels.append(p)
        panels.extend(p.get("panels", []))
    for p in panels:
        for t in p.get("targets", []):
            where = f"panel {p['id']} {p.get('title')!r} query {t.get('refId')}"
            out.append((where, t["expr"], bool(t.get("instant"))))
    return out


def is_serving(where):
    return where.startswith("panel ") and "'Serving" in where


def check_dashboard(url, dash, start, end, serving=False):
    variables = {v["name"]: v for v in dash["templating"]["list"] if v.get("type") == "query"}
    values = {}
    for name, v in variables.items():
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        values[name] = label_values(url, q, start, end)
        if not values[name]:
            fail(f"variable {name}: {q} returns no values")
    layers, nodes = values.get("layer") or ["0"], values.get("node") or [".*"]
    range_s = max(1, int(end - start))
    checked, empty = 0, []
    for where, expr, is_instant in dashboard_queries(dash):
        if is_serving(where) != serving:
            continue
        for layer in (layers if "$layer" in expr else layers[:1]):
            q = substitute(expr, layer, nodes, range_s)
            r = instant(url, q, end) if is_instant else range_query(url, q, start, end)
            checked += 1
            if has_data(r):
                continue
            if where in ALLOWED:
                print(f"allowed empty: {where}: {ALLOWED[where]}")
                break
            empty.append(f"{where} (layer {layer}): {q}")
    for e in empty:
        fail(f"no data: {e}")
    print(f"ok: variables {', '.join(f'{k}={v}' for k, v in values.items())}; "
          f"{checked} dashboard queries evaluated, {len(empty)} without data")


def check_rank_panels(url, dash, result, start, end):
    """The communication panels ("... by rank") show one series per rank of the job,
    each with its node and device (docs/metrics.md#ranks-across-worlds)."""
    ranks = {str(r) for r in range(len(result["rank_tokens"]))}
    panels = [p for p in dash.get("panels", []) if p.get("type") != "row" and p.get("title", "").endswith(" by rank")]
    if len(panels) < 3:
        fail(f"the dashboard has {len(panels)} panels by rank, not the three of communication")
    for p in panels:
        for t in p.get("targets", []):
            q = substitute(t["expr"], ".*", [".*"], max(1, int(end - start)))
            series = [s for s in range_query(url, q, start, end) if has_data([s])]
            got = {s["metric"].get("rank") for s in series}
            if got != ranks or any(not s["metric"].get("node") or not s["metric"].get("device") for s in series):
                fail(f"panel {p['title']!r}: series for ranks {sorted(got, key=str)}, not {sorted(ranks)} each with "
                     f"node and device: {[s['metric'] for s in series][:4]}")
    print(f"ok: {len(panels)} communication panels show a series per rank ({len(ranks)} ranks)")


def check(url, result_path, dash_path, start, end):
    with open(result_path) as f:
        result = json.load(f)
    with open(dash_path) as f:
        dash = json.load(f)
    start, end = float(start), float(end)
    check_expert_tokens(url, result)
    check_epochs(url, result, start, end)
    check_dashboard(url, dash, start, end)
    check_rank_panels(url, dash, result, start, end)
    return 1 if failures else 0


def serving(url, dash_path, start, end):
    with open(dash_path) as f:
        dash = json.load(f)
    check_dashboard(url, dash, float(start), float(end), serving=True)
    return 1 if failures else 0


def main():
    if len(sys.argv) == 6 and sys.argv[1] == "wait":
        return wait(*sys.argv[2:])
    if len(sys.argv) == 6 and sys.argv[1] == "serving":
        return serving(*sys.argv[2:])
    if len(sys.argv) == 7 and sys.argv[1] == "check":
        return check(*sys.argv[2:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
