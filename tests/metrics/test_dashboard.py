"""The Grafana dashboard (k8s/dashboards/pdserve.json) queries only series the cluster exports.

Every PromQL expression in it (panel targets and template-variable queries) goes through a small PromQL
tokenizer: it checks that brackets balance and that every function it calls is a PromQL function, and
pulls out the metric names (what is left once functions, aggregations, keywords, grouping labels, label
matchers, ranges, strings, numbers and Grafana variables are set aside). Each name must be one that a real
router or worker exports: the family names of their /metrics text with the suffixes each type's samples
carry (``_total`` for counters; ``_bucket``/``_sum``/``_count`` for histograms). A renamed or misspelled
series then fails here instead of leaving an empty panel.
"""
from __future__ import annotations

import copy
import json
import re
import threading
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from metrics import ROLES, RouterMetrics, WorkerMetrics
from tests.waiting import wait_until

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "dashboards" / "pdserve.json"

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                "quantile", "limitk", "limit_ratio"}
_OVER_TIME = {f"{a}_over_time" for a in ("avg", "min", "max", "sum", "count", "quantile", "stddev", "stdvar", "last",
                                         "present", "absent", "mad")}
FUNCTIONS = AGGREGATIONS | _OVER_TIME | {
    "abs", "absent", "acos", "acosh", "asin", "asinh", "atan", "atanh", "ceil", "changes", "clamp", "clamp_max",
    "clamp_min", "cos", "cosh", "day_of_month", "day_of_week", "day_of_year", "days_in_month", "deg", "delta",
    "deriv", "exp", "floor", "histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile",
    "histogram_stddev", "histogram_stdvar", "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate",
    "label_join", "label_replace", "ln", "log10", "log2", "minute", "month", "pi", "predict_linear", "rad", "rate",
    "resets", "round", "scalar", "sgn", "sin", "sinh", "sort", "sort_by_label", "sort_by_label_desc", "sort_desc",
    "sqrt", "tan", "tanh", "time", "timestamp", "vector", "year"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = GROUPING | {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<var>\$(?:\{[A-Za-z0-9_:.]+\}|[A-Za-z0-9_]+))
  | (?P<num>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)(?:ms|s|m|h|d|w|y)*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^=<>@,(){}\[\]:])
""", re.VERBOSE)
_CLOSE = {"(": ")", "{": "}", "[": "]"}


def tokenize(expr: str) -> list[tuple[str, str]]:
    """(kind, text) tokens of a PromQL expression, whitespace dropped; ValueError on a character PromQL has not."""
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot tokenize {expr[pos:pos + 20]!r} in {expr!r}")
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (see module docstring); ValueError when it does not parse."""
    toks = tokenize(expr)
    stack: list[str] = []
    names: set[str] = set()
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        if text in _CLOSE:
            stack.append(text)
        elif text in _CLOSE.values():
            if not stack or _CLOSE[stack.pop()] != text:
                raise ValueError(f"unbalanced {text!r} in {expr!r}")
        elif stack and stack[-1] in "{[":
            # label matchers and ranges: only {__name__="..."} names a metric
            if kind == "ident" and text == "__name__" and nxt == "=" and i + 2 < len(toks) and toks[i + 2][0] == "str":
                names.add(toks[i + 2][1][1:-1])
        elif kind == "ident":
            if text in GROUPING and nxt == "(":
                depth, i = 0, i + 1  # skip the label list: (le, role)
                while i < len(toks):
                    depth += {"(": 1, ")": -1}.get(toks[i][1], 0)
                    if depth == 0:
                        break
                    i += 1
                if depth:
                    raise ValueError(f"unbalanced grouping in {expr!r}")
            elif nxt == "(" and text not in KEYWORDS:
                if text not in FUNCTIONS:
                    raise ValueError(f"{text!r} is not a PromQL function (in {expr!r})")
            elif text in AGGREGATIONS and nxt in ("by", "without"):
                pass  # sum by (x) (...)
            elif text not in KEYWORDS:
                names.add(text)
        i += 1
    if stack:
        raise ValueError(f"unclosed {stack[-1]!r} in {expr!r}")
    return names


def _label_values_names(query: str) -> set[str]:
    """Grafana's label_values(selector, label) / label_values(label): the selector's metric names."""
    m = re.fullmatch(r"\s*label_values\((.*)\)\s*", query, re.S)
    if m is None:
        m = re.fullmatch(r"\s*query_result\((.*)\)\s*", query, re.S)
        return metric_names(m.group(1) if m else query)
    args = m.group(1)
    depth = 0
    for j in range(len(args) - 1, -1, -1):  # the last top-level comma splits selector and label
        depth += {")": 1, "}": 1, "(": -1, "{": -1}.get(args[j], 0)
        if args[j] == "," and depth == 0:
            return metric_names(args[:j])
    return set()  # label_values(label): no metric


def queries(dashboard: dict) -> Iterator[tuple[str, str, set[str]]]:
    """(where, expression, metric names) of every query: panel targets (rows' nested panels too) and variables."""
    def walk(panels: list) -> Iterator[dict]:
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))

    for p in walk(dashboard.get("panels", [])):
        for t in p.get("targets", []):
            if "expr" in t:
                yield f"panel {p.get('title')!r} target {t.get('refId')}", t["expr"], metric_names(t["expr"])
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            yield f"variable ${v['name']}", q, _label_values_names(q)


def exported_names(text: str) -> set[str]:
    """Every metric name a /metrics text lets a query select: family names with their type's suffixes."""
    names: set[str] = set()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}
    for fam in text_string_to_metric_families(text):
        names.update(fam.name + s for s in suffixes.get(fam.type, ("",)))
        names.update(s.name for s in fam.samples)
    return names


def unknown_names(dashboard: dict, exported: set[str]) -> list[str]:
    """'where: name' for each name a query selects that no component exports."""
    return [f"{where}: {name}" for where, _expr, names in queries(dashboard) for name in sorted(names - exported)]


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _component_texts() -> dict[str, str]:
    """/metrics text of a bare component of each role (the owner table's series and the process collectors)."""
    return {role: (RouterMetrics("tiny", "router-0") if role == "router" else WorkerMetrics("tiny", role, f"{role}-0"))
            .render().decode() for role in ROLES}


# ---- the tokenizer ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("expr, names", [
    ('histogram_quantile(0.99, sum by (le) (rate(pdserve:time_to_first_token_seconds_bucket'
     '{model_name=~"$model_name"}[$__rate_interval])))', {"pdserve:time_to_first_token_seconds_bucket"}),
    ("sum(rate(a_total[5m])) by (role) / on (role) group_left (x) max without (worker) (b)", {"a_total", "b"}),
    ('count by (role) (pdserve:num_requests_running{role!="router", model_name=~"a|b"}) > bool 0',
     {"pdserve:num_requests_running"}),
    ('{__name__="pdserve:kv_cache_usage_perc"} offset 5m', {"pdserve:kv_cache_usage_perc"}),
    ("rate(x[5m:1m]) and y unless z or 1.5e3", {"x", "y", "z"}),
    ('label_replace(up, "dst", "$1", "src", "(.*)")', {"up"}),
])
def test_tokenizer_finds_the_metric_names(expr, names):
    assert metric_names(expr) == names


@pytest.mark.parametrize("expr", ["sum(rate(x[5m])", "histogram_quantil(0.9, x)", "x{a=\"b\"", "rate(x[5m)]",
                                  "x # y"])
def test_tokenizer_rejects_what_does_not_parse(expr):
    with pytest.raises(ValueError):
        metric_names(expr)


def test_label_values_names_only_the_selector():
    assert _label_values_names("label_values(pdserve:num_requests_running{role=\"decode\"}, model_name)") == \
        {"pdserve:num_requests_running"}
    assert _label_values_names("label_values(model_name)") == set()


# ---- the dashboard ----------------------------------------------------------------------------------------

def test_dashboard_has_the_panels_an_operator_reads():
    dash = load_dashboard()
    assert dash["uid"] == "pdserve" and dash["panels"]
    found = list(queries(dash))
    exprs = " ".join(e for _w, e, _n in found)
    names = set().union(*(n for _w, _e, n in found))
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                   "request_time_per_output_token_seconds", "kv_transfer_time_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(pdserve:{metric}_bucket" in exprs, (metric, q)
    for name in ("pdserve:prompt_tokens_total", "pdserve:generation_tokens_total", "pdserve:router_requests_waiting",
                 "pdserve:request_errors_total", "pdserve:request_migrations_total",
                 "pdserve:degraded_requests_total", "pdserve:num_preemptions_total"):
        assert name in names, name
    assert "sum by (code) (rate(pdserve:request_errors_total" in exprs
    assert "avg by (role) (pdserve:kv_cache_usage_perc" in exprs  # KV usage per pool
    assert "count by (role) (pdserve:num_requests_running" in exprs  # pool sizes
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p.get("targets"), p["title"]


def test_every_dashboard_query_names_a_series_some_component_exports():
    exported = set().union(*(exported_names(t) for t in _component_texts().values()))
    assert unknown_names(load_dashboard(), exported) == []


def test_a_misspelled_or_unowned_metric_is_caught():
    exported = set().union(*(exported_names(t) for t in _component_texts().values()))
    dash = load_dashboard()
    bad = copy.deepcopy(dash)
    target = next(p for p in bad["panels"] if p["title"] == "Time to first token (TTFT)")["targets"][0]
    target["expr"] = target["expr"].replace("time_to_first_token_seconds_bucket", "time_to_first_token_second_bucket")
    assert unknown_names(bad, exported) == [
        "panel 'Time to first token (TTFT)' target A: pdserve:time_to_first_token_second_bucket"]
    # a histogram has no _total; a counter has no _bucket
    bad = copy.deepcopy(dash)
    bad["panels"][1]["targets"][0]["expr"] = "rate(pdserve:inter_token_latency_seconds_total[5m])"
    bad["templating"]["list"][1]["query"]["query"] = "label_values(pdserve:prompt_tokens_bucket, model_name)"
    assert unknown_names(bad, exported) == [
        f"panel {bad['panels'][1]['title']!r} target A: pdserve:inter_token_latency_seconds_total",
        "variable $model_name: pdserve:prompt_tokens_bucket"]
    # a worker series no worker exports would read empty: the pool-size panel counts a series every worker has
    worker_only = set().union(*(exported_names(t) for r, t in _component_texts().items() if r != "router"))
    assert "pdserve:num_requests_running" in worker_only
    assert "pdserve:num_requests_running" not in exported_names(_component_texts()["router"])


def _scrape(address: str) -> str:
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()


def test_dashboard_queries_what_a_real_router_and_workers_export():
    """The same check against the /metrics of real roles after a request (start_roles, metrics on)."""
    from tests.roles.harness import KV, collect, joined, start_roles

    torch.set_num_threads(1)
    roles = start_roles(kv=KV, tag="dash-", metrics=True)
    try:
        assert joined(collect(roles.stub, prompt="def f(x):", max_tokens=3, temperature=0.0))[2] == "length"
        assert roles.wait_idle(2.0)
        texts = {"router": _scrape(roles.router.metrics_address)}
        texts.update({w.cfg.worker_id: _scrape(w.metrics_address) for w in [*roles.prefills, *roles.decodes]})
    finally:
        roles.close()
    exported = {who: exported_names(t) for who, t in texts.items()}
    assert unknown_names(load_dashboard(), set().union(*exported.values())) == []
    # pool sizes: every worker exports the series the panel counts, the router does not
    for who, names in exported.items():
        assert ("pdserve:num_requests_running" in names) == (who != "router"), who
    wait_until(lambda: not [t.name for t in threading.enumerate() if "dash-" in t.name and t.is_alive()],
               timeout=10.0, message="every thread of the dashboard test's workers ended")
