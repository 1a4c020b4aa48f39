"""The soak's analysis and report: per-window latencies, RSS growth, the router's counters, the offline check.

Lifecycle: pure functions the soak's ``main`` calls once the load has ended and the cluster has stopped
(``router_counters`` also before the load, ``check_offline`` loads the offline engine), then ``print_report``
prints the result dict as rich tables.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any, Optional

import numpy as np


def ok(rec: Any) -> bool:
    """A request that streamed tokens and ended with a finish reason other than abort."""
    return rec.success and bool(rec.finish_reason)


def outcomes(recs: list) -> Counter:
    """"OK", or the failure's kind (loadtest's ``error_counts`` keys: the gRPC status name, ...)."""
    from loadtest.stats import error_counts

    out = Counter({"OK": sum(ok(r) for r in recs)})
    out.update(error_counts(recs))
    out.update({"no finish_reason": sum(r.success and not r.finish_reason for r in recs)})
    return +out  # drops zero counts


# ---- analysis ---------------------------------------------------------------------------------------------
def pct(xs: list, q: float) -> Optional[float]:
    return float(np.percentile(xs, q)) if xs else None


def windows(recs: list, window_s: float, duration_s: float) -> list[dict]:
    from loadtest.stats import itls_s, ttft_s

    n = max(1, int(np.ceil(duration_s / window_s)))
    out = []
    for w in range(n):
        lo, hi = w * window_s, (w + 1) * window_s
        sent = [r for r in recs if lo <= r.start_s < hi]
        ttft = [ttft_s(r) * 1e3 for r in sent if ok(r)]
        itl = [gap * 1e3 for r in recs if ok(r) for gap, b in zip(itls_s(r), r.chunk_times_s[1:]) if lo <= b < hi]
        out.append({"window": f"{lo:.0f}-{min(hi, duration_s):.0f} s", "sent": len(sent),
                    "ok": sum(ok(r) for r in sent), "failed": sum(not ok(r) for r in sent),
                    "p50_ttft_ms": pct(ttft, 50), "p99_ttft_ms": pct(ttft, 99),
                    "p50_itl_ms": pct(itl, 50), "p99_itl_ms": pct(itl, 99)})
    return out


def rss_summary(rss: dict) -> list[dict]:
    out = []
    for name, series in rss.items():
        if not series:
            continue
        first, last = series[0][1], series[-1][1]
        out.append({"process": name, "from_s": series[0][0], "to_s": series[-1][0], "samples": len(series),
                    "rss_first_mib": first / 2**20, "rss_last_mib": last / 2**20,
                    "rss_max_mib": max(v for _, v in series) / 2**20, "growth_mib": (last - first) / 2**20})
    return out


def router_counters(metrics_address: str) -> dict:
    """The router's request_errors (by code), request_success and request_migrations totals, read from its
    Prometheus /metrics at ``metrics_address`` (host:port)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"errors": {}, "success": 0.0, "migrations": 0.0}
    try:
        with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if not s.name.endswith("_total"):
                    continue
                if "request_errors" in s.name:
                    out["errors"][s.labels.get("code", "?")] = s.value
                elif "request_success" in s.name:
                    out["success"] += s.value
                elif "request_migrations" in s.name:
                    out["migrations"] += s.value
    except Exception as e:
        out["error"] = repr(e)
    return out


def in_flight_at(recs: list, times_s: list[float]) -> set[str]:
    """Ids of the requests in flight at any of ``times_s`` (sent before, ended after): a fault there may have
    made the router retry or migrate them."""
    return {r.request_id for r in recs for t in times_s if r.start_s <= t <= r.end_s}


def check_offline(model: str, pairs: list[tuple[Any, Any]]) -> dict:
    """Greedy outputs of (BenchRequest, RequestRecord) pairs against the offline engine, token for token."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model)
    outs = llm.generate([{"prompt_token_ids": q.prompt_token_ids} for q, _ in pairs],
                        [SamplingParams(max_tokens=q.max_tokens, temperature=0.0, ignore_eos=True) for q, _ in pairs])
    bad = [r.request_id for (_, r), o in zip(pairs, outs) if list(o.token_ids) != list(r.token_ids)]
    return {"checked": len(pairs), "matched": len(pairs) - len(bad), "mismatched_ids": bad,
            "checked_ids": [r.request_id for _, r in pairs]}


def pick_check_sample(recs: list, first_ids: set, n: int) -> list:
    """``n`` successful records: up to half of them from ``first_ids`` (those a fault touched matter most),
    the rest spread over the run."""
    good = [r for r in recs if ok(r)]
    first = [r for r in good if r.request_id in first_ids][: n // 2]
    rest = [r for r in good if r.request_id not in first_ids]
    k = n - len(first)
    step = max(1, len(rest) // max(1, k))
    return first + rest[::step][:k]


# ---- report -----------------------------------------------------------------------------------------------
def print_report(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=150)
    s = res["summary"]
    con.print(f"[bold]soak[/bold]: {res['settings']['model']}, {res['settings']['prefill']}P+{res['settings']['decode']}D, "
              f"{s['offered_rate']:.2f} req/s offered ({res['settings']['load']:g} x capacity "
              f"{res['capacity'].get('req_per_s', float('nan')):.2f} req/s) for {res['settings']['duration_s']:g} s; "
              f"trace {res['workload']['trace']} lengths x{res['workload']['length_scale']:g} "
              f"({res['workload']['num_clipped_to_model_limits']} clipped)")
    t = Table(title="summary")
    t.add_column("what")
    t.add_column("value", justify="right")
    rows = [("requests sent", s["requests"]), ("succeeded", s["succeeded"]), ("lost (failed)", s["lost"]),
            ("errors by code", json.dumps(s["errors_by_code"]) or "{}"),
            ("migrations during the load (router metric)", s["migrations"]),
            ("in flight at a fault: ok / failed", f"{s['in_flight_at_faults_ok']} / {s['in_flight_at_faults_failed']}"),
            ("router counters", json.dumps(res["router_counters"])),
            ("faults injected / survived", f"{s['faults_injected']} / {s['faults_survived']}"),
            ("KV blocks not free at end", s["blocks_not_free"]), ("Redis keys left after stop", s["keys_left"]),
            ("greedy outputs = offline", f"{res['offline_check']['matched']}/{res['offline_check']['checked']}"),
            ("load average start / end", f"{res['machine']['loadavg_start']} / {res['machine']['loadavg_end']}")]
    for k, v in rows:
        t.add_row(k, str(v))
    con.print(t)
    t = Table(title="faults")
    for col in ("t (s)", "fault", "survived", "recovery (s)"):
        t.add_column(col)
    for f in res["faults"]:
        t.add_row(f"{f['t_s']:.0f}", f.get("what", f.get("error", "")), str(f["survived"]), str(f.get("recovery_s")))
    con.print(t)
    t = Table(title=f"per window ({res['settings']['window_s']:g} s, by send time)")
    for col in ("window", "sent", "ok", "failed", "p50 TTFT ms", "p99 TTFT ms", "p50 ITL ms", "p99 ITL ms"):
        t.add_column(col, justify="right")
    f1 = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for w in res["windows"]:
        t.add_row(w["window"], str(w["sent"]), str(w["ok"]), str(w["failed"]), f1(w["p50_ttft_ms"]),
                  f1(w["p99_ttft_ms"]), f1(w["p50_itl_ms"]), f1(w["p99_itl_ms"]))
    con.print(t)
    t = Table(title="RSS")
    for col in ("process", "from s", "to s", "first MiB", "last MiB", "max MiB", "growth MiB"):
        t.add_column(col, justify="right")
    for r in res["rss"]:
        t.add_row(r["process"], f"{r['from_s']:.0f}", f"{r['to_s']:.0f}", f"{r['rss_first_mib']:.1f}",
                  f"{r['rss_last_mib']:.1f}", f"{r['rss_max_mib']:.1f}", f"{r['growth_mib']:+.1f}")
    con.print(t)
    t = Table(title="workers at the end")
    for col in ("worker", "total blocks", "free", "not free", "running", "waiting"):
        t.add_column(col, justify="right")
    for b in res["blocks_at_end"]:
        t.add_row(b["worker_id"], *(str(b.get(k)) for k in ("total", "free", "not_free", "running", "waiting")))
    con.print(t)
