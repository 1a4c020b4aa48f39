"""The SLA planner policy: each pool sized from the observed load, a profile's step model and the SLOs.

Lifecycle: ``pdserve up|controller --autoscale --planner sla`` builds an ``SlaConfig`` (the profile from
``pdserve profile``, the TTFT and TPOT SLOs) and the ``Planner`` (cluster/planner.py) makes an
``SlaPolicy`` of it. Every planner tick hands the policy the registry's ``WorkerInfo`` records of each
pool and the pools' live sizes: ``CounterWindow.observe`` sums the workers' cumulative counters
(``requests_total``, ``prompt_tokens_total``, ``output_tokens_total``, ``requests_finished_total``) into
one running total, ``CounterWindow.load`` differences that total over a sliding window into the offered
``Load`` (arrival rate, mean prompt and output length), ``plan`` turns the load into the sizes the SLOs
need (formulas below), and ``Hysteresis`` keeps the pools from flapping. Everything here is arithmetic on
its inputs and the times it is given: no clock, no Redis, no Ray, so a test (or the simulator, which
drives the same ``Planner``) checks it by hand.

Counters (``CounterWindow``): a worker's counters are cumulative since it started. The window keeps each
worker's last record and adds what every counter grew by since; a worker seen for the first time after
the first observation adds all of its counters (it started since, from 0); a counter that went down is a
restarted worker (counted from 0 again: it adds its new value); a worker that left adds nothing more. A
worker older than these fields reports 0 for all of them (the proto3 default), so while old workers serve,
the observed rate counts only the new ones' share. Estimates over the window [t0, t1]:

    rate = d(requests_total) / (t1 - t0)                        arrivals (each request is counted once: by the
                                                                prefill worker that prefills it, or by the decode /
                                                                colocated worker that runs it whole)
    p    = d(prompt_tokens_total) / d(requests_total)            mean prompt length
    o    = d(output_tokens_total) / d(requests_finished_total)   mean output length (tokens per finished request;
                                                                both rates are capped alike by an overloaded pool,
                                                                so their ratio stays right where d(requests_total)
                                                                would not)

Formulas (``plan``), with lambda the rate, h the headroom factor, M the engine's per-step token budget
(``max_num_batched_tokens``), r the router's work before a prompt reaches its worker (``router_per_request_s``;
for a prefill/decode pair ``router_per_request_pair_s`` when the profile has it), L the model's layers, kvb
its KV bytes per token, link(bytes) the profile's KV link and step(.) the duration of one engine step as the
simulator prices it: the profile's step model plus, for a step that streams, ``router_per_step_s`` and
``router_per_token_s`` for every row that samples (the serving path's work runs on the worker's cores:
``simulator.engine_sim``):

Prefill pool (disaggregated). A lone prompt of p tokens takes
    s(p) = prefill_s(p) = sum over its chunks of M tokens (n after c) of the step of that chunk alone (T = n,
                          PA = n (c + (n + 1) / 2), PC = c + n, PX = n c, PN = 1: simulator.costs.step_features),
                          the last chunk sampling the first token (S = 1); s = s(p) at the mean length.
The counters give the mean prompt length only; the lengths are taken as exponentially distributed with that mean
(capped at the profile's max_model_len, stretched to keep the mean), which matches the conversation trace's
prefill moments on a real profile and is conservative for prompts of one length. Over them (Gauss-Laguerre
nodes, ``prompt_lengths``):
    E[s] = the mean lone prefill,   cs2 = Var[s] / E[s]^2
The router sends each prompt to the ready prefill worker with the fewest queued prompt tokens (about the least work
left), so the c workers of the pool act as one FCFS queue with c servers (M/G/c), not c separate ones. Offered
a = lambda E[s] Erlangs, a prompt waits with the Erlang C probability C(c, a), and then about exponentially long
with mean (1 + cs2) / 2 * E[s] / (c - a) (the M/M/c wait scaled by the service's variability, Allen-Cunneen):
    W_q(c) = (1 + cs2) / 2 * E[s] / (c - a) * ln(C(c, a) / q)   (0 when C(c, a) <= q)
the wait's (1 - q) quantile, q = 0.1 - ``long_prompt_share`` (0.07, so q = 0.03): of the 10% of prompts the SLO
lets miss, the share is left to the mix's long prompts, which miss a tight SLO by their own prefill whatever the
wait. A prompt that waited shares its step with the prompts that reached its worker meanwhile (the scheduler packs the queue
into one step of up to M tokens): x W_q of them at x = lambda / c, about rho W_q of work (rho = a / c), at most
the rest of a full step:
    B(c) = min(rho W_q(c), full_s - s),   full_s = the step of M tokens of fresh p-token prompts (M / p of them,
                                          each sampling; a prompt longer than M: 0)
With the decode worker's step the Reserve waits for (ITL(B*), below):
    TTFT90(c) = r + ITL(B*) + E[s] + W_q(c) + B(c)
    prefill replicas = the smallest c >= h lambda E[s] / rho_max with TTFT90(c) <= TTFT SLO (at lambda h)
(c grows until it holds; TTFT90 falls to r + ITL(B*) + E[s] as C(c, a) falls below q). ``Plan.per_replica``
reports h lambda / c, the rate each worker is planned to take.

Decode pool (disaggregated). The prefill worker samples the first token, so a request decodes o_d = max(1, o - 1)
tokens here, at a mean context of ctx = p + o / 2. One step of B running sequences takes
    ITL(B) = step(T = B, S = B, DC = B * ctx)
           = lin(B) + router_per_step_s + (per_sampled_row_s + router_per_token_s) * B + per_decode_ctx_s * B * ctx
A request's TPOT also pays its KV hand-off after the first token, kv = max(link(p kvb / L), link(p kvb) - s)
(layer by layer, overlapped with the last prefill step), and about one step's wait to join the batch:
    TPOT(B) = ITL(B) * (1 + 1 / o_d) + kv / o_d
    B* = the largest B <= min(max_num_seqs, kv_tokens / (p + o)) with TPOT(B) <= TPOT SLO
    per-replica throughput mu_D = B* / ITL(B*) (tokens/s);   decode replicas = ceil(h * lambda * o_d / mu_D)
(at lambda * o_d / mu_D workers each runs B* sequences on average: Little's law with a step of ITL(B*)).

Colocated pool. A worker takes x req/s and spends u = x * s of its time prefilling (chunks ride in the same
steps as the decodes), which stretches every decode step: with B = x * o_d * TPOT sequences running,
    TPOT(x) = ITL(B) / (1 - u)                          (a fixed point in B, iterated)
    TTFT90(x) = r + s + ITL(B) + s * max(0, ln(10 u)) / (1 - u)   (the step in flight, then the prompts ahead)
    mu_C = the largest x with both within their SLOs (bisection);   colocated replicas = ceil(h * lambda / mu_C)

An SLO no size can meet (TTFT SLO <= r + ITL(B*) + E[s] for prefill, a lone request missing either SLO for
colocated, or TPOT(1) above the TPOT SLO) is reported in ``Plan.notes``; the pool is then sized at utilisation
``rho_infeasible`` (prefill: c = ceil(h lambda E[s] / rho_infeasible); colocated) or batch 1 (decode), and the
bounds cap it. Every size is clamped to the pool's [min, max].

Hysteresis: a pool grows to its target at once (by as many workers as it takes); it shrinks only to the
largest target of the last ``scale_down_after_s`` seconds, and not before the policy has watched that long.
The planner's cooldown still applies between two changes of a pool.

The sizes are not checked by a simulation at run time; tests/cluster/test_sla_planner.py runs this policy
inside the real ``Planner`` against the simulator (pdserve's own scheduler and router) on a rate ramp and checks
the prefill size against the simulator's smallest pool that meets the TTFT SLO; benchmarks/sla_prefill_sizing.py
makes that comparison over rates, lengths (one length, the conversation trace's mix) and SLOs.
"""
from __future__ import annotations

import functools
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from numpy.polynomial.laguerre import laggauss

from simulator.costs import Profile, StepFeatures

log = logging.getLogger(__name__)

COUNTERS = ("requests_total", "prompt_tokens_total", "output_tokens_total", "requests_finished_total")
"""The WorkerInfo counters the window sums (cumulative per worker)."""


@dataclass
class SlaConfig:
    """What the SLA policy needs besides the observed load."""

    profile: Profile
    """The deployment's measured costs (``pdserve profile``; ``simulator.costs.load_profile``)."""
    ttft_slo_ms: float
    """Time-to-first-token SLO: the 90th percentile TTFT the prefill (or colocated) pool is sized to meet."""
    tpot_slo_ms: float
    """Time-per-output-token SLO: the decode (or colocated) pool is sized so a request's TPOT stays within it."""
    headroom: float = 1.2
    """Sizes are for headroom x the observed rate (prediction error, Poisson bursts, a ramp inside the window)."""
    window_s: float = 60.0
    """The sliding window the rate and the lengths are measured over."""
    min_window_s: float = 10.0
    """No sizing until the window holds this much history (the pools keep their size meanwhile)."""
    scale_down_after_s: float = 120.0
    """A pool shrinks only to the largest size wanted during this long."""
    rho_max: float = 0.9
    """Highest prefill (colocated: prefill-time) utilisation planned for, whatever the TTFT SLO allows."""
    rho_infeasible: float = 0.5
    """Utilisation planned for when no size meets the TTFT SLO (the prompts alone take longer)."""
    long_prompt_share: float = 0.07
    """Of the 10% of prompts the TTFT SLO lets miss, the share left to the length mix's long prompts, which miss a
    tight SLO by their own prefill whatever the wait (the counters give the mean length only): the prefill pool's
    wait is planned at its (0.9 + share) quantile. 0.07: in the conversation trace 7% of the prompts take more
    than twice the mean-length prompt's prefill. 0 plans the wait's 90th percentile."""
    max_num_batched_tokens: int = 2048
    """The engines' per-step token budget (prompts longer than this are prefilled in chunks)."""
    max_num_seqs: int = 64
    """Most sequences a decode (colocated) engine runs at once."""
    kv_tokens: Optional[int] = None
    """Tokens of KV cache per decode (colocated) worker (caps the batch); None: no cap."""
    kv_link: str = "gloo"
    """The profile's KV link that prices the hand-off from prefill to decode."""

    def __post_init__(self) -> None:
        if not isinstance(self.profile, Profile):
            raise ValueError(f"profile must be a simulator.costs.Profile, got {type(self.profile).__name__}")
        for name in ("ttft_slo_ms", "tpot_slo_ms", "window_s", "headroom"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if self.headroom < 1.0:
            raise ValueError(f"headroom must be >= 1, got {self.headroom!r}")
        if not 0 <= self.min_window_s <= self.window_s:
            raise ValueError(f"min_window_s must be within [0, window_s], got {self.min_window_s!r}")
        if self.scale_down_after_s < 0:
            raise ValueError(f"scale_down_after_s must be >= 0, got {self.scale_down_after_s!r}")
        for name in ("rho_max", "rho_infeasible"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be within (0, 1), got {getattr(self, name)!r}")
        if not 0 <= self.long_prompt_share < 0.1:
            raise ValueError(f"long_prompt_share must be within [0, 0.1), got {self.long_prompt_share!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"kv_tokens must be >= 1 or None, got {self.kv_tokens!r}")


@dataclass(frozen=True)
class Load:
    """The offered load over the window."""

    rate: float
    """Requests per second."""
    prompt_tokens: float
    """Mean prompt length."""
    output_tokens: float
    """Mean output length (tokens per request, every choice)."""


@dataclass
class Plan:
    """What ``plan`` found: the sizes and the per-replica capacities behind them."""

    sizes: dict[str, int]
    """Role -> replicas the load needs (before bounds and hysteresis)."""
    per_replica: dict[str, float]
    """Role -> planned throughput of one replica (prefill, colocated: req/s; decode: tokens/s)."""
    detail: dict[str, float] = field(default_factory=dict)
    """Intermediate values (prefill_s, rho_P, batch B*, ITL(B*), kv_s, ...), for logs and tests."""
    notes: list[str] = field(default_factory=list)
    """SLOs no size can meet."""


# ---- the step model's pieces ---------------------------------------------------------------------------------
def step_seconds(profile: Profile, f: StepFeatures) -> float:
    """One engine step as the simulator prices it (``simulator.engine_sim.SimRunner``): the step model plus the
    serving path's work for each token the step streams."""
    return profile.step_seconds(f)


def prefill_seconds(profile: Profile, prompt_tokens: float, chunk: int) -> float:
    """A lone fresh prompt of ``prompt_tokens`` (at least 1; not rounded: the step model is priced at fractional
    lengths too, so a mean over lengths is exact for the polynomial parts) prefilled in chunks of ``chunk``."""
    n_total = max(1.0, float(prompt_tokens))
    c, total = 0.0, 0.0
    while c < n_total:
        n = min(chunk, n_total - c)
        last = c + n >= n_total
        total += step_seconds(profile, StepFeatures(tokens=n, sampled=1 if last else 0,
                                                    prefill_pairs=n * (c + (n + 1) / 2), prefill_ctx=c + n,
                                                    prefill_cached_pairs=n * c, prefill_chunks=1))
        c += n
    return total


def decode_step_seconds(profile: Profile, batch: int, ctx: float) -> float:
    """ITL(B): one decode step of ``batch`` sequences at a mean context of ``ctx`` tokens."""
    return step_seconds(profile, StepFeatures(tokens=batch, sampled=batch, decode_ctx=int(round(batch * ctx))))


def kv_handoff_seconds(profile: Profile, prompt_tokens: float, prefill_s: float, link: str) -> float:
    """How long after the first token a prompt's KV is on the decode worker (the simulator's rule)."""
    nbytes = prompt_tokens * profile.kv_bytes_per_token
    lk = profile.link(link)
    return max(lk.seconds(nbytes / profile.num_layers), lk.seconds(nbytes) - prefill_s)


LENGTH_NODES = 24
"""Gauss-Laguerre nodes over the assumed (exponential) prompt lengths: exact for a step model polynomial in the
length (the pair terms: up to degree 4 for the second moment) away from the chunk and knot kinks."""


@functools.lru_cache(maxsize=None)
def _laguerre(n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    x, w = laggauss(n)
    return tuple(float(v) for v in x), tuple(float(v) for v in w)


def prompt_lengths(mean_tokens: float, max_len: int, n: int = LENGTH_NODES) -> list[tuple[float, float]]:
    """(length, weight) pairs of exponentially distributed prompt lengths with mean ``mean_tokens`` (Gauss-Laguerre
    nodes): capped at ``max_len`` and stretched so that the capped lengths keep the mean (all at ``max_len`` when
    the mean is that long)."""
    m = max(1.0, float(mean_tokens))
    if m >= max_len:
        return [(float(max_len), 1.0)]
    x, w = _laguerre(n)

    def mean_at(k: float) -> float:
        return sum(wi * min(max_len, k * xi) for xi, wi in zip(x, w))

    k = m
    if mean_at(k) < m * (1 - 1e-12):  # the cap cut the mean: stretch the rest (bisection on the scale)
        lo, hi = m, 2 * m
        while mean_at(hi) < m:
            lo, hi = hi, 2 * hi
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mean_at(mid) < m else (lo, mid)
        k = hi
    return [(min(float(max_len), max(1.0, k * xi)), wi) for xi, wi in zip(x, w)]


def prefill_moments(profile: Profile, mean_tokens: float, chunk: int) -> tuple[float, float]:
    """(E[s], cs^2): the mean lone prefill and its squared coefficient of variation over ``prompt_lengths``."""
    nodes = prompt_lengths(mean_tokens, profile.max_model_len)
    vals = [(prefill_seconds(profile, p, chunk), w) for p, w in nodes]
    es = sum(w * v for v, w in vals)
    e2 = sum(w * v * v for v, w in vals)
    return es, max(0.0, e2 / (es * es) - 1)


def full_step_seconds(profile: Profile, prompt_tokens: float, chunk: int) -> float:
    """A step packed to the budget: ``chunk / p`` fresh prompts of p = ``prompt_tokens`` tokens, each sampling its
    first token (a prompt longer than the budget: one chunk of it, sampling nothing)."""
    p = max(1.0, min(float(prompt_tokens), chunk))
    k = chunk / p
    return step_seconds(profile, StepFeatures(tokens=chunk, sampled=k if prompt_tokens <= chunk else 0,
                                              prefill_pairs=k * p * (p + 1) / 2, prefill_ctx=chunk,
                                              prefill_chunks=k))


def erlang_c(c: int, a: float) -> float:
    """P(wait > 0) in an M/M/c queue offered ``a`` Erlangs (1 at a >= c): Erlang B by its recursion, then C."""
    if a <= 0:
        return 0.0
    if a >= c:
        return 1.0
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    return c * b / (c - a * (1 - b))


def wait_p90(rho: float, service_s: float) -> float:
    """90th percentile wait of an M/M/1 queue with mean service ``service_s`` at utilisation ``rho``."""
    if rho <= 0.1:
        return 0.0
    if rho >= 1:
        return math.inf
    return service_s * math.log(10 * rho) / (1 - rho)


def _bisect_max(ok: Callable[[float], bool], lo: float, hi: float, iters: int = 60) -> float:
    """The largest x in [lo, hi] with ok(x), for ok true up to some point and false after (ok(lo) holds)."""
    if ok(hi):
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _replicas(demand: float, per_replica: float) -> int:
    if demand <= 0:
        return 0
    return max(1, math.ceil(demand / per_replica - 1e-9))


# ---- per-replica capacities ----------------------------------------------------------------------------------
def _prefill_model(cfg: SlaConfig, load: Load, rate: float, decode_itl_s: float
                   ) -> tuple[Callable[[int], float], dict[str, float]]:
    """TTFT90(c) (seconds) of c prefill workers offered ``rate`` req/s (module docstring: the pooled queue; inf past
    utilisation ``rho_max``), and the terms that do not depend on c (s, E[s], cs2, a, r + ITL(B*))."""
    prof, m_tok = cfg.profile, cfg.max_num_batched_tokens
    s = prefill_seconds(prof, load.prompt_tokens, m_tok)
    es, cs2 = prefill_moments(prof, load.prompt_tokens, m_tok)
    pair = prof.router_per_request_pair_s
    over = (prof.router_per_request_s if pair is None else max(pair, prof.router_per_request_s)) + decode_itl_s
    rest = max(0.0, full_step_seconds(prof, load.prompt_tokens, m_tok) - s)
    a = rate * es
    q = 0.1 - cfg.long_prompt_share

    def ttft90(c: int) -> float:
        if c < 1 or a > cfg.rho_max * c:
            return math.inf
        pc = erlang_c(c, a)
        w = (1 + cs2) / 2 * es / (c - a) * math.log(pc / q) if pc > q else 0.0
        return over + es + w + min(a / c * w, rest)

    return ttft90, dict(s=s, es=es, cs2=cs2, a=a, over=over)


def prefill_size(cfg: SlaConfig, load: Load, rate: float, plan: Plan, decode_itl_s: float) -> int:
    """Prefill workers for ``rate`` req/s (module docstring): the fewest whose TTFT90 meets the SLO; ``decode_itl_s``:
    the decode worker's step, which the Reserve before every prefill waits for; fills ``plan.detail``."""
    ttft90, t = _prefill_model(cfg, load, rate, decode_itl_s)
    slo = cfg.ttft_slo_ms / 1000
    plan.detail.update(prefill_s=t["s"], prefill_mean_s=t["es"], prefill_cs2=t["cs2"])
    if t["over"] + t["es"] >= slo:
        plan.notes.append(f"TTFT SLO {cfg.ttft_slo_ms:g} ms is below the {1000 * (t['over'] + t['es']):.0f} ms a "
                          f"prompt of a {load.prompt_tokens:.0f}-token mean length takes alone on average: sized at "
                          f"utilisation {cfg.rho_infeasible:g}")
        c = max(1, math.ceil(t["a"] / cfg.rho_infeasible - 1e-9))
    else:
        c = max(1, math.ceil(t["a"] / cfg.rho_max - 1e-9))
        while ttft90(c) > slo:  # falls to r + ITL(B*) + E[s] < SLO as c grows
            c += 1
    plan.detail.update(rho_prefill=t["a"] / c, prefill_ttft90_s=ttft90(c))
    return c


def decode_capacity(cfg: SlaConfig, load: Load, plan: Plan, prefill_s: float) -> float:
    """mu_D (tokens/s) of one decode worker (module docstring); fills ``plan.detail``."""
    prof = cfg.profile
    o_d = max(1.0, load.output_tokens - 1)
    ctx = load.prompt_tokens + load.output_tokens / 2
    kv = kv_handoff_seconds(prof, load.prompt_tokens, prefill_s, cfg.kv_link)
    cap = cfg.max_num_seqs
    if cfg.kv_tokens is not None:
        cap = max(1, min(cap, int(cfg.kv_tokens // max(1.0, load.prompt_tokens + load.output_tokens))))
    slo = cfg.tpot_slo_ms / 1000

    def tpot(b: int) -> float:
        return decode_step_seconds(prof, b, ctx) * (1 + 1 / o_d) + kv / o_d

    best = max((b for b in range(1, cap + 1) if tpot(b) <= slo), default=0)
    if best == 0:
        plan.notes.append(f"TPOT SLO {cfg.tpot_slo_ms:g} ms is below one sequence's {1000 * tpot(1):.1f} ms: "
                          "sized at batch 1")
        best = 1
    itl = decode_step_seconds(prof, best, ctx)
    plan.detail.update(decode_batch=best, itl_s=itl, kv_s=kv, decode_tokens_per_request=o_d)
    return best / itl


def colocated_capacity(cfg: SlaConfig, load: Load, plan: Plan) -> float:
    """mu_C (req/s) of one colocated worker (module docstring); fills ``plan.detail``."""
    prof = cfg.profile
    s = prefill_seconds(prof, load.prompt_tokens, cfg.max_num_batched_tokens)
    over = prof.router_per_request_s
    o_d = max(1.0, load.output_tokens - 1)
    ctx = load.prompt_tokens + load.output_tokens / 2
    cap = cfg.max_num_seqs
    if cfg.kv_tokens is not None:
        cap = max(1, min(cap, int(cfg.kv_tokens // max(1.0, load.prompt_tokens + load.output_tokens))))
    ttft_slo, tpot_slo = cfg.ttft_slo_ms / 1000, cfg.tpot_slo_ms / 1000

    def latencies(x: float) -> tuple[float, float, float]:
        u = x * s
        if u >= 1:
            return math.inf, math.inf, math.inf
        t = decode_step_seconds(prof, 1, ctx) / (1 - u)
        b = 1.0
        for _ in range(100):  # TPOT = ITL(B) / (1 - u), B = x o_d TPOT: a fixed point, reached from below
            b = max(1.0, x * o_d * t)
            if b > cap:
                return math.inf, math.inf, b
            t_new = decode_step_seconds(prof, math.ceil(b), ctx) / (1 - u)
            if abs(t_new - t) < 1e-12:
                break
            t = t_new
        itl = decode_step_seconds(prof, math.ceil(b), ctx)
        return over + s + itl + wait_p90(u, s), t, b

    def ok(x: float) -> bool:
        ttft, tpot, _ = latencies(x)
        return ttft <= ttft_slo and tpot <= tpot_slo

    lo = 1e-6 / s
    if not ok(lo):
        plan.notes.append(f"SLOs TTFT {cfg.ttft_slo_ms:g} ms / TPOT {cfg.tpot_slo_ms:g} ms are not met by a lone "
                          f"request on a colocated worker: sized at utilisation {cfg.rho_infeasible:g}")
        x = cfg.rho_infeasible / s
    else:
        x = _bisect_max(ok, lo, cfg.rho_max / s)
    ttft, tpot, b = latencies(x)
    plan.detail.update(prefill_s=s, colocated_rate=x, colocated_batch=b, ttft90_s=ttft, tpot_s=tpot)
    return x


def plan(cfg: SlaConfig, load: Load, mode: str = "disaggregated") -> Plan:
    """The replicas of each pool that serve ``load`` within the SLOs (module docstring), before bounds."""
    if mode not in ("disaggregated", "colocated"):
        raise ValueError(f"mode must be 'disaggregated' or 'colocated', got {mode!r}")
    out = Plan(sizes={}, per_replica={})
    demand = cfg.headroom * max(0.0, load.rate)
    if demand <= 0:  # nothing arrives: every pool at its floor
        out.sizes = {"colocated": 0} if mode == "colocated" else {"prefill": 0, "decode": 0}
        return out
    if mode == "colocated":
        mu = colocated_capacity(cfg, load, out)
        out.per_replica["colocated"] = mu
        out.sizes["colocated"] = _replicas(demand, mu)
        return out
    s = prefill_seconds(cfg.profile, load.prompt_tokens, cfg.max_num_batched_tokens)
    mu_d = decode_capacity(cfg, load, out, s)
    n_p = prefill_size(cfg, load, demand, out, out.detail["itl_s"])
    out.per_replica.update(prefill=demand / n_p, decode=mu_d)
    out.sizes["prefill"] = n_p
    out.sizes["decode"] = _replicas(demand * out.detail["decode_tokens_per_request"], mu_d)
    return out


# ---- observation ------------------------------------------------------------------------------------------------
class CounterWindow:
    """Sums the workers' cumulative counters over time and differences them over a sliding window."""

    def __init__(self, window_s: float, min_window_s: float = 0.0) -> None:
        self.window_s = window_s
        self.min_window_s = min_window_s
        self._last: dict[tuple[str, str], tuple[int, ...]] = {}
        self._totals = [0] * len(COUNTERS)
        self._samples: deque[tuple[float, tuple[int, ...]]] = deque()
        self._observed = False
        self._last_output: Optional[float] = None

    def observe(self, now: float, infos: Iterable) -> None:
        """Take one look at every live worker's record (``WorkerInfo``s of all pools) at time ``now``."""
        seen: dict[tuple[str, str], tuple[int, ...]] = {}
        for w in infos:
            key = (w.role, w.worker_id)
            cur = tuple(int(getattr(w, c)) for c in COUNTERS)
            seen[key] = cur
            prev = self._last.get(key)
            if prev is None:
                delta = cur if self._observed else (0,) * len(cur)  # new since the last look: counted from 0
            elif any(c < p for c, p in zip(cur, prev)):
                delta = cur  # restarted under the same id: counting from 0 again
            else:
                delta = tuple(c - p for c, p in zip(cur, prev))
            self._totals = [t + d for t, d in zip(self._totals, delta)]
        self._last = seen  # a worker that left adds nothing more; if it comes back it is new
        self._observed = True
        self._samples.append((now, tuple(self._totals)))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    @property
    def totals(self) -> dict[str, int]:
        """The running sums of every counter since the first look."""
        return dict(zip(COUNTERS, self._totals))

    def load(self) -> Optional[Load]:
        """The load over the window (from the last look at or before its start, to the latest look), or None
        before ``min_window_s`` of history."""
        if len(self._samples) < 2:
            return None
        (t0, c0), (t1, c1) = self._samples[0], self._samples[-1]
        span = t1 - t0
        if span < max(self.min_window_s, 1e-9):
            return None
        d = dict(zip(COUNTERS, (b - a for a, b in zip(c0, c1))))
        if d["requests_total"] <= 0:
            return Load(rate=0.0, prompt_tokens=0.0, output_tokens=self._last_output or 0.0)
        if d["requests_finished_total"] > 0:
            self._last_output = d["output_tokens_total"] / d["requests_finished_total"]
        out = self._last_output
        if out is None:  # nothing finished yet: what was sampled per request so far (a lower bound)
            out = max(1.0, d["output_tokens_total"] / d["requests_total"])
        return Load(rate=d["requests_total"] / span, prompt_tokens=d["prompt_tokens_total"] / d["requests_total"],
                    output_tokens=out)


class Hysteresis:
    """Up at once; down only to the largest target of the last ``down_after_s`` (module docstring)."""

    def __init__(self, down_after_s: float) -> None:
        self.down_after_s = down_after_s
        self._targets: dict[str, deque[tuple[float, int]]] = {}
        self._since: dict[str, float] = {}

    def apply(self, role: str, now: float, current: int, target: int) -> int:
        hist = self._targets.setdefault(role, deque())
        since = self._since.setdefault(role, now)
        hist.append((now, target))
        while hist and hist[0][0] < now - self.down_after_s:
            hist.popleft()
        if target >= current:
            return target
        if now - since < self.down_after_s:
            return current  # not watched long enough to know the lower size is enough
        return min(current, max(n for _, n in hist))


class SlaPolicy:
    """The ``sla`` planner policy: targets for every pool from the counters in the registry."""

    name = "sla"

    def __init__(self, cfg: SlaConfig, mode: str, bounds: Callable[[str], tuple[int, int]]) -> None:
        self.cfg = cfg
        self.mode = mode
        self.bounds = bounds
        self.window = CounterWindow(cfg.window_s, cfg.min_window_s)
        self.hysteresis = Hysteresis(cfg.scale_down_after_s)
        self.last_load: Optional[Load] = None
        self.last_plan: Optional[Plan] = None
        self._noted: set[str] = set()

    def targets(self, infos: dict[str, list], current: dict[str, int], now: float) -> dict[str, int]:
        """Role -> the size each pool should have now (``current`` where there is nothing to judge yet)."""
        self.window.observe(now, [w for ws in infos.values() for w in ws])
        load = self.window.load()
        out = {}
        p = None
        if load is not None:
            p = plan(self.cfg, load, self.mode)
            self.last_load, self.last_plan = load, p
            for note in p.notes:
                if note not in self._noted:
                    self._noted.add(note)
                    log.warning("sla planner: %s", note)
        for role, cur in current.items():
            lo, hi = self.bounds(role)
            if cur < lo or cur > hi:
                out[role] = min(max(cur, lo), hi)  # out of bounds (a crash, a fresh start): snap back at once
                continue
            if p is None:
                out[role] = cur
                continue
            want = min(max(p.sizes.get(role, 0), lo), hi)
            out[role] = self.hysteresis.apply(role, now, cur, want)
        return out
