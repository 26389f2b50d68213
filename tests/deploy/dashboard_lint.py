#!/usr/bin/env python3
"""Structural checks of deploy/grafana/moed.json and deploy/prometheus/rules.yml.

usage: dashboard_lint.py DASHBOARD_JSON RULES_YML [--exposition METRICS_TEXT]...

Checks, each failure printed with the place it was found:
- the variables datasource (a Prometheus data source variable), node and layer exist, and every
  $variable a query or title uses is defined (or one of Grafana's built-ins);
- every panel has an id (unique), a place inside the 24-column grid, and at least one query; every
  query has a refId (unique in its panel), a non-empty expr and the ${datasource} data source;
- every metric name a query (panels, annotations, variables) or a rule uses is one of
  docs/metrics.md's (histograms with their _bucket/_sum/_count series) or a series rules.yml
  records (rules may also use Prometheus' own `up`); every label a selector matches is one that
  metric carries (its documented labels plus the file_sd labels role and node, and instance),
  every by/without/on label is one of the expression's metrics' labels, and nothing uses the
  label `job` (Prometheus owns it);
- the panels docs/operations.md#the-dashboard-deploygrafanamoedjson promises exist (checked by what they query).

With --exposition (the text of a live /metrics, e.g. of a daemon and of the agent; repeatable),
the names are checked against what the processes export instead: every metric and label a query
or rule uses must be in one of the expositions, and every documented metric must be exported there
with its type and exactly its labels (prometheus_server_test.sh).
"""
import json
import re
import sys

import yaml

# The metrics of docs/metrics.md (#daemon-metrics, #agent-metrics): name -> (type, labels).
# moe_build_info is exported by both processes (the agent's with `version` only).
DOCUMENTED_METRICS = {
    "moe_expert_tokens_total": ("counter", {"layer", "expert", "rank"}),
    "moe_rank_tokens_total": ("counter", {"layer", "rank"}),
    "moe_dispatch_seconds": ("histogram", {"direction", "layer", "rank", "device"}),
    "moe_combine_seconds": ("histogram", {"direction", "layer", "rank", "device"}),
    "moe_expert_compute_seconds": ("histogram", {"direction"}),
    "moe_transport_bytes_total": ("counter", {"op", "direction", "layer", "rank", "device"}),
    "moe_transport_received_bytes_total": ("counter", {"op", "direction", "layer", "rank", "device"}),
    "moe_naive_transport_bytes_total": ("counter", {"op"}),
    "moe_step_seconds": ("histogram", set()),
    "moe_rebalance_copy_bytes_total": ("counter", set()),
    "moe_build_info": ("gauge", {"version", "backend", "gemm_engine"}),
    "moe_serve_calls_total": ("counter", {"layer", "kind", "outcome"}),
    "moe_serve_rows_total": ("counter", {"layer", "kind"}),
    "moe_serve_call_seconds": ("histogram", {"layer", "kind"}),
    "moe_serve_queued_rows": ("gauge", set()),
    "moe_placement_epoch": ("gauge", {"layer"}),
    "moe_placement_balancedness": ("gauge", {"layer"}),
    "moe_expert_replicas": ("gauge", {"layer", "expert"}),
    "moe_expert_load": ("gauge", {"layer", "expert"}),
    "moe_rebalances_total": ("counter", {"result"}),
    "moe_rebalance_seconds": ("histogram", set()),
    "moe_world_changes_total": ("counter", {"cause"}),
    "moe_world_change_recovery_seconds": ("histogram", set()),
    "moe_nodes": ("gauge", {"state"}),
    "moe_jobs": ("gauge", {"state"}),
    "moe_agent_state_saved": ("gauge", set()),
    "moe_placement_shape_info": ("gauge", {"shape"}),
    "moe_job_step": ("gauge", {"job_id", "name"}),
    "moe_job_steps": ("gauge", {"job_id", "name"}),
    "moe_job_loss": ("gauge", {"job_id", "name"}),
    "moe_job_tokens_per_second": ("gauge", {"job_id", "name"}),
    "moe_job_step_seconds": ("gauge", {"job_id", "name"}),
    "moe_job_eta_seconds": ("gauge", {"job_id", "name"}),
}
TARGET_LABELS = {"role", "node", "instance"}  # file_sd labels and Prometheus' instance
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s",
                    "__range_ms", "__from", "__to", "__all", "__dashboard", "__org", "__user",
                    "__name", "timeFilter", "__timeFilter"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
            "unless", "offset", "inf", "nan", "atan2", "start", "end"}

errors = []
KNOWN_FROM = "docs/metrics.md"  # or the expositions given


def error(where, msg):
    errors.append(f"{where}: {msg}")


def series_labels():
    """Every series name a query may use -> the labels it carries."""
    names = {}
    for name, (kind, labels) in DOCUMENTED_METRICS.items():
        labels = labels | TARGET_LABELS
        if kind == "histogram":
            names[name + "_bucket"] = labels | {"le"}
            names[name + "_sum"] = labels
            names[name + "_count"] = labels
        else:
            names[name] = labels
    return names


def parse_exposition(paths):
    """(series name -> labels, family name -> type) from Prometheus text expositions."""
    series, types = {}, {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.startswith("# TYPE "):
                    parts = line.split()
                    types[parts[2]] = parts[3]
                    continue
                m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s", line)
                if m:
                    series.setdefault(m.group(1), set()).update(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2) or ""))
    return series, types


def check_live(series, types):
    """Every documented metric exported with its type and exactly its labels; no label `job`."""
    for name, (kind, labels) in DOCUMENTED_METRICS.items():
        sample = name + "_count" if kind == "histogram" else name
        if types.get(name) != kind or sample not in series:
            error("exposition", f"{name}: not exported as a {kind} (TYPE {types.get(name)}, samples: {sample in series})")
            continue
        if series[sample] != labels:
            error("exposition",
                  f"{name}: exported with labels {sorted(series[sample])}, docs/metrics.md says {sorted(labels)}")
    for name, labels in series.items():
        if "job" in labels:
            error("exposition", f"{name} carries the label job (Prometheus owns it)")


def grouping_labels(expr):
    return {l.strip() for m in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
            for l in m.group(1).split(",") if l.strip()}


def load_rules(path):
    with open(path) as f:
        doc = yaml.safe_load(f)
    records, exprs = {}, []
    for group in doc.get("groups", []):
        for rule in group.get("rules", []):
            where = f"{path}: " + (f"record {rule['record']}" if "record" in rule else f"alert {rule.get('alert')}")
            exprs.append((where, str(rule["expr"])))
            if "record" in rule:
                labels = grouping_labels(str(rule["expr"])) | set((rule.get("labels") or {}).keys())
                records.setdefault(rule["record"], set()).update(labels)
    return records, exprs


def strip_strings(expr):
    return re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)


def check_expr(where, expr, known, extra_names=()):
    """Checks one PromQL expression (Grafana variables allowed); returns the metric names it uses."""
    if not expr or not expr.strip():
        error(where, "empty query")
        return set()
    s = strip_strings(expr)
    s = re.sub(r"\[\[\w+\]\]|\$\{\w+(?::\w+)?\}|\$\w+", "1", s)  # Grafana variables
    used = set()
    # Selectors with matchers: metric{label op "value", ...}
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}", s):
        name, body = m.group(1), m.group(2)
        labels = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", body))
        if "job" in labels:
            error(where, "matches the label job (Prometheus owns it; use role/node)")
        if name and name in known:
            bad = labels - known[name] - {"__name__"}
            if bad:
                error(where, f"{name} has no label(s) {sorted(bad)} (it has {sorted(known[name])})")
    s = re.sub(r"\{[^}]*\}", " ", s)
    # by/without/on/ignoring/group_* label lists
    clause_labels = set()
    for m in re.finditer(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", s):
        clause_labels |= {l.strip() for l in m.group(2).split(",") if l.strip()}
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = re.sub(r"\boffset\s+-?\w+", " ", s)
    s = re.sub(r"(?<![\w:.])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?![\w:])", " ", s)  # numbers
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", s):
        tok = m.group(0)
        if tok.lower() in KEYWORDS:
            continue
        if re.match(r"\s*\(", s[m.end():]):  # a function or an aggregation
            continue
        if tok in known or tok in extra_names:
            used.add(tok)
        else:
            error(where, f"uses {tok!r}, which is neither a metric of {KNOWN_FROM} nor a recorded series")
    if "job" in clause_labels:
        error(where, "groups or matches by the label job (Prometheus owns it)")
    available = set().union(*(known.get(n, set()) for n in used)) | {"le"} if used else {"le"}
    bad = clause_labels - available
    if bad and used:
        error(where, f"by/without/on label(s) {sorted(bad)} are not labels of {sorted(used)}")
    return used


def variables_in(text):
    """The names of the Grafana variables ($x, ${x}, ${x:fmt}, [[x]]) in text."""
    found = re.findall(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", text or "")
    return {next(g for g in groups if g) for groups in found}


def main():
    global KNOWN_FROM
    args, expositions = sys.argv[1:], []
    while "--exposition" in args:
        i = args.index("--exposition")
        if i + 1 >= len(args):
            break
        expositions.append(args[i + 1])
        del args[i:i + 2]
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    dash_path, rules_path = args
    records, rule_exprs = load_rules(rules_path)
    known = series_labels()
    if expositions:
        series, types = parse_exposition(expositions)
        check_live(series, types)
        known = {name: labels | TARGET_LABELS for name, labels in series.items()}
        KNOWN_FROM = "the live /metrics in " + ", ".join(expositions)
    for name, labels in records.items():
        known[name] = labels

    # Rules: only documented names, recorded names and Prometheus' up.
    rule_known = dict(known, up=TARGET_LABELS | {"job"})
    for where, expr in rule_exprs:
        check_expr(where, expr, rule_known)

    with open(dash_path) as f:
        dash = json.load(f)

    variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
    ds = variables.get("datasource")
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        error("templating", "needs a variable `datasource` of type datasource for prometheus")
    for name in ("node", "layer"):
        v = variables.get(name)
        if not v or v.get("type") != "query":
            error("templating", f"needs a query variable `{name}`")
            continue
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else q or ""
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", q)
        if not m:
            error(f"variable {name}", f"query {q!r} is not label_values(selector, label)")
            continue
        used = check_expr(f"variable {name}", m.group(1), known)
        if m.group(2) not in (set().union(*(known[n] for n in used)) if used else set()):
            error(f"variable {name}", f"label {m.group(2)} is not a label of {sorted(used)}")
        if v.get("datasource", {}).get("uid") != "${datasource}":
            error(f"variable {name}", "must query the ${datasource} data source")
    defined = set(variables) | GRAFANA_BUILTINS

    used_everywhere = set()
    queries = []  # (panel type, panel title, expr)

    def check_text(where, text):
        for var in variables_in(text):
            if var not in defined:
                error(where, f"uses the undefined variable ${var}")

    for i, anno in enumerate(dash.get("annotations", {}).get("list", [])):
        if anno.get("builtIn"):
            continue
        where = f"annotation {anno.get('name', i)!r}"
        expr = (anno.get("target") or {}).get("expr", "")
        if anno.get("datasource", {}).get("uid") != "${datasource}":
            error(where, "must use the ${datasource} data source")
        check_text(where, expr)
        used_everywhere |= check_expr(where, expr, known)
        queries.append(("annotation", anno.get("name", ""), expr))

    panels = []
    for p in dash.get("panels", []):
        panels.append(p)
        panels.extend(p.get("panels", []) if p.get("type") == "row" else [])
    ids, cells = set(), {}
    for p in panels:
        where = f"panel {p.get('id')} {p.get('title')!r}"
        if not isinstance(p.get("id"), int) or p["id"] in ids:
            error(where, "needs a unique integer id")
        ids.add(p.get("id"))
        g = p.get("gridPos") or {}
        if not all(isinstance(g.get(k), int) for k in "xywh") or g["x"] < 0 or g["w"] < 1 or g["x"] + g["w"] > 24:
            error(where, f"gridPos {g} is not inside the 24-column grid")
        else:
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    if (x, y) in cells:
                        error(where, f"overlaps panel {cells[(x, y)]}")
                        break
                    cells[(x, y)] = p.get("id")
                else:
                    continue
                break
        check_text(where, p.get("title", ""))
        if p.get("repeat") and p["repeat"] not in variables:
            error(where, f"repeats over the undefined variable {p['repeat']}")
        if p.get("type") == "row":
            continue
        if (p.get("datasource") or {}).get("uid") != "${datasource}":
            error(where, "must use the ${datasource} data source")
        targets = p.get("targets") or []
        if not targets:
            error(where, "has no query")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or not all(refs):
            error(where, f"refIds {refs} are not unique and non-empty")
        for t in targets:
            tw = f"{where} query {t.get('refId')}"
            if (t.get("datasource") or {}).get("uid") != "${datasource}":
                error(tw, "must use the ${datasource} data source")
            check_text(tw, t.get("expr", ""))
            check_text(tw, t.get("legendFormat", ""))
            used_everywhere |= check_expr(tw, t.get("expr", ""), known)
            queries.append((p.get("type"), p.get("title", ""), t.get("expr", "")))

    # The panels docs/operations.md promises, found by what they query.
    def has(ptype, pattern):
        return any((ptype is None or t == ptype) and re.search(pattern, e) for t, _, e in queries)

    promised = [
        ("per-expert load heatmap", "heatmap", r"moe_expert_tokens_total"),
        ("per-expert load bars", "barchart", r"moe_expert_tokens_total"),
        ("per-rank load", "timeseries", r"moe_rank_tokens_total"),
        ("balancedness from rates", "timeseries", r"layer:moe_rank_balancedness:rate1m"),
        ("placement epoch", "timeseries", r"moe_placement_epoch"),
        ("epoch change annotation", "annotation", r"moe_placement_epoch"),
        ("rebalance annotation", "annotation", r"moe_rebalances_total"),
        ("sent bytes", "timeseries", r"moe_transport_bytes_total"),
        ("received bytes", "timeseries", r"moe_transport_received_bytes_total"),
        ("naive bytes", "timeseries", r"moe_naive_transport_bytes_total"),
        ("step time", "timeseries", r"histogram_quantile\(0\.99,.*moe_step_seconds_bucket"),
        ("throughput", "timeseries", r"sum by \(layer\) \(rate\(moe_rank_tokens_total"),
        ("nodes up", None, r'moe_nodes\{state="alive"'),
        ("job states", None, r"moe_jobs"),
        ("job progress", "stat", r"moe_job_step / moe_job_steps"),
        ("job loss", "timeseries", r"moe_job_loss"),
        ("job throughput", "timeseries", r"moe_job_tokens_per_second"),
        # communication per rank (docs/metrics.md#ranks-across-worlds)
        ("dispatch time by rank", "timeseries", r"sum by \(le, node, device, rank\) \(rate\(moe_dispatch_seconds_bucket"),
        ("combine time by rank", "timeseries", r"sum by \(le, node, device, rank\) \(rate\(moe_combine_seconds_bucket"),
        ("bytes sent by rank", "timeseries", r"sum by \(node, device, rank\) \(rate\(moe_transport_bytes_total"),
    ]
    for metric in ("moe_dispatch_seconds", "moe_combine_seconds", "moe_expert_compute_seconds"):
        for q in ("0.5", "0.99"):
            promised.append((f"{metric} p{q}", "timeseries",
                             rf"histogram_quantile\({q}, sum by \([^)]*direction[^)]*\) \(rate\({metric}_bucket"))
    for what, ptype, pattern in promised:
        if not has(ptype, pattern):
            error("dashboard", f"no {ptype or 'panel'} shows {what} (a query matching {pattern!r})")

    if errors:
        for e in errors:
            print("FAIL", e)
        print(f"{len(errors)} problem(s) in {dash_path} / {rules_path}")
        return 1
    print(f"ok: {len(panels)} panels, {len(queries)} queries, {len(rule_exprs)} rules, names checked against "
          f"{KNOWN_FROM}; metrics used: "
          + ", ".join(sorted(used_everywhere)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
