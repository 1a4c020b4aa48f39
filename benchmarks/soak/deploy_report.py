"""The deployment soak's analysis: request outcomes by reason, deployment, key and constraint; duplicated
tokens; per-window latency; router counters from ``/metrics``; the RSS plot.

Lifecycle: pure functions over the records, faults and samples ``main`` (``deployment.py``) hands them at the end.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional


from benchmarks.soak.clients import CONSTRAINTS, PERSON, REGEX, Rec


# ---- analysis ---------------------------------------------------------------------------------------------
def classify(recs: list[Rec], faults: list[dict]) -> dict:
    """Served / refused by the capped key's quota / lost, why each lost one was lost, and the same by
    deployment, key and constraint."""
    kills = [(f["t_s"], f.get("victim")) for f in faults if f["kind"] == "kill_router"]
    why: Counter = Counter()
    for r in recs:
        if not r.lost:
            continue
        died = any(v == r.failed_on and r.t_send <= t <= (r.t_end or 1e18) for t, v in kills)
        if died and r.tokens:
            why["its router was killed mid-stream"] += 1
        elif r.quota:
            why[f"refused by the quota of key {r.key or '(none)'} ({r.quota}): a quota bug"] += 1
        elif r.tokens:
            why[f"error after {len(r.tokens)} tokens: {r.error.split(':')[0]}"] += 1
        elif r.error:
            why[f"before any token, after {r.attempts} attempts: {r.error.split(':')[0]}"] += 1
        else:
            why["unfinished at the end"] += 1

    def tally(sel: Callable[[Rec], str]) -> dict:
        out: dict = {}
        for r in recs:
            t = out.setdefault(sel(r) or "none", {"sent": 0, "served": 0, "refused_by_quota": 0, "lost": 0})
            t["sent"] += 1
            t["served"] += r.ok
            t["refused_by_quota"] += r.refused_by_quota
            t["lost"] += r.lost
        return out

    return {"sent": len(recs), "served": sum(r.ok for r in recs), "lost": sum(r.lost for r in recs),
            "refused_by_quota": sum(r.refused_by_quota for r in recs),
            "refused_by_quota_limits": dict(Counter(r.quota for r in recs if r.refused_by_quota)),
            "lost_why": dict(why), "retried_then_served": sum(r.ok and r.attempts > 1 for r in recs),
            "served_via_other_router": sum(r.ok and len(set(r.routers)) > 1 for r in recs),
            "lost_with_router_alive": sum(v for k, v in why.items() if "router was killed" not in k),
            "by_deployment": tally(lambda r: r.stack), "by_key": tally(lambda r: r.key),
            "by_constraint": tally(lambda r: r.constraint)}


def windows(recs: list[Rec], window_s: float, duration_s: float) -> list[dict]:
    import numpy as np

    def p(xs: list, q: float) -> Optional[float]:
        return round(float(np.percentile(xs, q)), 1) if xs else None

    out = []
    for w in range(max(1, int(np.ceil(duration_s / window_s)))):
        lo, hi = w * window_s, (w + 1) * window_s
        sent = [r for r in recs if lo <= r.t_send < hi]
        ttft = [(r.t_first - r.t_send) * 1e3 for r in sent if r.ok and r.t_first is not None]
        itl = [(b - a) * 1e3 for r in recs if r.ok for a, b in zip(r.chunk_times, r.chunk_times[1:]) if lo <= b < hi]
        out.append({"window": f"{lo:.0f}-{hi:.0f} s", "sent": len(sent), "served": sum(r.ok for r in sent),
                    "p50_ttft_ms": p(ttft, 50), "p99_ttft_ms": p(ttft, 99), "p50_itl_ms": p(itl, 50),
                    "p99_itl_ms": p(itl, 99)})
    return out


def valid_structured(r: Rec) -> bool:
    """A served constrained answer that stopped is one the constraint accepts (one that ran out of max_tokens is
    a prefix and is not judged)."""
    if r.finish != "stop":
        return True
    if r.constraint == "regex":
        return re.fullmatch(REGEX, r.text) is not None
    import jsonschema

    try:
        jsonschema.validate(json.loads(r.text), PERSON)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def duplicates(recs: list[Rec], reqs: list, model: str, sample: int) -> dict:
    """Unconstrained requests with another number of tokens than asked (they run with ``ignore_eos``), constrained
    ones with more than asked or an answer the constraint refuses, and a sample (those retried first, a quarter
    constrained when there are some) against the offline engine: greedy, the constrained ones under the same
    constraint (``engine.LLM``, the constraint converted as the router converts it)."""
    from engine import LLM, SamplingParams
    from proto import pdserve_pb2
    from router.wire import structured_outputs_from_proto

    good = [r for r in recs if r.ok]
    over = [r.i for r in good if not r.constraint and len(r.tokens) != r.max_tokens]
    over += [r.i for r in good if r.constraint and len(r.tokens) > r.max_tokens]
    invalid = [r.i for r in good if r.constraint and not valid_structured(r)]
    pick = [r for r in good if r.attempts > 1][: sample // 2]
    constrained = [r for r in good if r.attempts == 1 and r.constraint]
    n_con = min(len(constrained), max(0, sample // 4 - sum(bool(r.constraint) for r in pick)))
    pick += constrained[:: max(1, len(constrained) // max(1, n_con))][:n_con]
    rest = [r for r in good if r.attempts == 1 and not r.constraint]
    pick += rest[:: max(1, len(rest) // max(1, sample - len(pick)))][: max(0, sample - len(pick))]

    def params(r: Rec) -> Any:
        if not r.constraint:
            return SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
        fld, value = CONSTRAINTS[r.constraint]
        so = structured_outputs_from_proto(pdserve_pb2.StructuredOutputs(**{fld: value}))
        return SamplingParams(max_tokens=r.max_tokens, temperature=0.0, structured_outputs=so)

    llm = LLM(model=model, num_threads=1)
    outs = llm.generate([{"prompt_token_ids": reqs[r.i].prompt_token_ids} for r in pick], [params(r) for r in pick])
    bad = [r.i for r, o in zip(pick, outs) if list(o.token_ids) != r.tokens]
    return {"wrong_length": len(over), "wrong_length_ids": over[:20], "structured_served": sum(bool(r.constraint)
            for r in good), "structured_stopped": sum(bool(r.constraint) and r.finish == "stop" for r in good),
            "structured_invalid": len(invalid), "structured_invalid_ids": invalid[:20],
            "offline_checked": len(pick), "offline_checked_structured": sum(bool(r.constraint) for r in pick),
            "offline_mismatched": len(bad), "offline_mismatched_ids": bad[:20]}


def plot_rss(rss: dict, faults: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 6))
    colors = plt.cm.tab20.colors
    for k, (name, series) in enumerate(sorted(rss.items())):
        if series:
            ax.plot([t for t, _ in series], [v / 2**20 for _, v in series], label=name, lw=1,
                    color=colors[k % len(colors)], ls=("-", "--", ":")[(k // len(colors)) % 3])
    for f in faults:
        ax.axvline(f["t_s"], color="grey", ls=":", lw=0.8)
        ax.text(f["t_s"], ax.get_ylim()[1], f["kind"].replace("kill_", "-9 "), rotation=90, va="top", fontsize=7)
    ax.set_xlabel("time since load start (s)")
    ax.set_ylabel("RSS (MiB)")
    ax.legend(fontsize=6, ncol=3, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
