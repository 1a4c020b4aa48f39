"""The deployment soak's load: the request plan (which deployment, key and constraint each trace
request takes), client threads that retry like real clients, and ``Rec``, one request's record.

Lifecycle: ``plan_requests`` assigns the trace's requests before the load starts; ``Client.run`` sends each on
its schedule from a thread pool, retrying UNAVAILABLE / RESOURCE_EXHAUSTED (not a quota refusal) with backoff
through the deployment's other router, and fills a ``Rec`` per request for ``deploy_report.py``.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import grpc

from benchmarks.soak.stack import Deployment


RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
QUOTA_REFUSAL = re.compile(r"key '([^']*)': .*\((requests_per_s|tokens_per_min|max_concurrent)[:)]")
"""The router's message of a quota refusal (``router.quotas.QuotaBook.admit``): the key's name and the limit."""
STRUCTURED_MIN_TOKENS = 48
"""A constrained request asks at least this many tokens (the schema's answer is about 32 on ``tiny``)."""
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CONSTRAINTS = {"json": ("json", json.dumps(PERSON)), "regex": ("regex", REGEX)}
"""Constraint kind -> (the StructuredOutputs field, its value), the same on the wire and offline."""


@dataclass
class Rec:
    """One client request, as the client saw it (times from the load's start)."""

    i: int
    max_tokens: int
    t_send: float
    stack: str = "pd"
    """The deployment it was sent to: pd (disaggregated) or colo (colocated)."""
    key: str = ""
    """The API key's name (main, capped; "" without quotas)."""
    constraint: str = ""
    """Its structured-output constraint (json, regex; "" none)."""
    t_first: Optional[float] = None
    t_end: Optional[float] = None
    chunk_times: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    text: str = ""
    finish: str = ""
    error: str = ""
    quota: str = ""
    """The limit that refused it (requests_per_s, tokens_per_min, max_concurrent; "" none)."""
    attempts: int = 0
    routers: list = field(default_factory=list)
    """The routers tried, in order (their process names)."""
    failed_on: Optional[str] = None
    """The router the request was lost on."""

    @property
    def ok(self) -> bool:
        return bool(self.finish) and not self.error

    @property
    def refused_by_quota(self) -> bool:
        """Refused by the capped key's quota: expected, not lost."""
        return bool(self.quota) and self.key == "capped"

    @property
    def lost(self) -> bool:
        return not self.ok and not self.refused_by_quota

# ---- the client -------------------------------------------------------------------------------------------
@dataclass
class Planned:
    """What one trace request becomes: its deployment, key, constraint and max_tokens."""

    stack: str
    key: str
    constraint: str
    max_tokens: int


def plan_requests(ns: argparse.Namespace, reqs: list, limits: Any) -> list[Planned]:
    """Each request's deployment (``--colocated-share``), key (``--capped-share``) and constraint (every
    ``--structured-every``-th, alternately json and regex), drawn from ``--seed``; a constrained request's
    max_tokens raised to ``STRUCTURED_MIN_TOKENS`` within the model's limits."""
    rng = random.Random(ns.seed + 17)
    out = []
    every = ns.structured_every
    for i, q in enumerate(reqs):
        stack = "colo" if ns.colocated and rng.random() < ns.colocated_share else "pd"
        key = ("capped" if rng.random() < ns.capped_share else "main") if ns.quotas else ""
        constraint = ("json", "regex")[(i // every) % 2] if every and i % every == every - 1 else ""
        mt = q.max_tokens
        if constraint:
            mt = max(mt, STRUCTURED_MIN_TOKENS)
            if limits.max_new_tokens:
                mt = min(mt, limits.max_new_tokens)
            if limits.max_context_length:
                mt = max(1, min(mt, limits.max_context_length - len(q.prompt_token_ids)))
        out.append(Planned(stack, key, constraint, mt))
    return out


def plan_summary(plan: list[Planned]) -> dict:
    return {"by_deployment": dict(Counter(p.stack for p in plan)), "by_key": dict(Counter(p.key for p in plan)),
            "by_constraint": dict(Counter(p.constraint or "none" for p in plan))}


class Client:
    """Sends each request at its time on a thread pool; retries before the first token, fails over routers."""

    def __init__(self, dep: "Deployment", timeout_s: float, retries: int, seed: int) -> None:
        from proto import pdserve_pb2, pdserve_pb2_grpc
        from transport.auth import bearer_metadata

        self.pb, self.timeout_s, self.retries = pdserve_pb2, timeout_s, retries
        self.names = {st.label: [r.name for r in st.routers] for st in dep.stacks}
        self.channels = {st.label: [grpc.insecure_channel(t) for t in st.targets] for st in dep.stacks}
        self.stubs = {label: [pdserve_pb2_grpc.PDServeStub(c) for c in chs] for label, chs in self.channels.items()}
        self.metadata = {name: bearer_metadata(tok) for name, tok in dep.keys.items()}
        self.rng = random.Random(seed)
        self.recs: list[Rec] = []

    def run(self, reqs: list, plan: list[Planned], t0: float, stop: threading.Event) -> None:
        with ThreadPoolExecutor(max_workers=96, thread_name_prefix="client") as pool:
            for i, (q, p) in enumerate(zip(reqs, plan)):
                delay = t0 + q.arrival_s - time.perf_counter()
                if delay > 0 and stop.wait(delay):
                    break
                rec = Rec(i, p.max_tokens, time.perf_counter() - t0, stack=p.stack, key=p.key,
                          constraint=p.constraint)
                self.recs.append(rec)
                pool.submit(self._one, q, rec, t0, i % len(self.stubs[p.stack]))

    def message(self, q: Any, rec: Rec) -> Any:
        kw: dict = dict(token_ids=q.prompt_token_ids, max_tokens=rec.max_tokens, temperature=0.0,
                        ignore_eos=not rec.constraint)  # a constraint ends its answer itself
        if rec.constraint:
            fld, value = CONSTRAINTS[rec.constraint]
            kw["structured_outputs"] = self.pb.StructuredOutputs(**{fld: value})
        return self.pb.GenerateRequest(**kw)

    def _one(self, q: Any, rec: Rec, t0: float, k: int) -> None:
        req = self.message(q, rec)
        stubs, names = self.stubs[rec.stack], self.names[rec.stack]
        md = self.metadata.get(rec.key, ())
        for attempt in range(self.retries + 1):
            rec.attempts += 1
            rec.routers.append(names[k])
            try:
                for msg in stubs[k].Generate(req, timeout=self.timeout_s, metadata=md):
                    now = time.perf_counter() - t0
                    if msg.token_ids:
                        rec.t_first = rec.t_first if rec.t_first is not None else now
                        rec.chunk_times.append(now)
                        rec.tokens.extend(msg.token_ids)
                    rec.text += msg.text
                    if msg.finish_reason:
                        rec.finish = msg.finish_reason
                rec.t_end = time.perf_counter() - t0
                return
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
                quota = QUOTA_REFUSAL.search(details) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
                if quota is None and not rec.tokens and code in RETRYABLE and attempt < self.retries:
                    if code == grpc.StatusCode.UNAVAILABLE:
                        k = 1 - k  # its router may be gone: the other one
                    time.sleep(min(8.0, 0.25 * 2 ** attempt) * (0.5 + self.rng.random()))
                    continue
                if quota is not None:
                    rec.quota = quota.group(2)
                rec.error = f"{code.name}: {details[:160]}"
                rec.failed_on = names[k]
                rec.t_end = time.perf_counter() - t0
                return

    def close(self) -> None:
        for chs in self.channels.values():
            for c in chs:
                c.close()
