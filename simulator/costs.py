"""The cost model a simulation runs on: a profile's fitted step, transfer and router costs.

Lifecycle: ``pdserve profile`` (simulator/profile.py) measures an engine's steps, the KV
link and the router on one machine and writes ``profile.json``; ``load_profile(path)``
reads and checks it once into a ``Profile``; the simulator asks its ``CostModel`` for the
duration of every engine step it schedules (from the step's ``StepFeatures``), of every KV
transfer and of the router's per-request and per-token work. Nothing here measures or
touches a model: it is arithmetic on the profile's fitted coefficients, so a test can hand
the simulator a profile with round numbers and check its latencies by hand.

The step model (one engine step = one forward of a mixed batch, plus sampling):

    seconds = lin(T) + per_sampled_row_s * S + per_prefill_pair_s * PA + per_decode_ctx_s * DC
              + per_prefill_ctx_s * PC + per_prefill_chunk_s * PN + per_prefill_cached_pair_s * PX

with T the step's tokens (prefill chunk tokens + one per decoding sequence), S the rows
that sample, PA the prefill chunks' attention pairs (sum over chunks of n * (c + (n + 1) / 2)
for a chunk of n tokens after c cached or computed ones), DC the decoding sequences'
context lengths summed and PC the keys the prefill chunks read (sum over chunks of c + n):
the CPU prefill kernel gathers every key of a chunk's context once, whatever n, so a few new
tokens after a long cached prefix cost far more than their pairs (``per_prefill_ctx_s`` is
optional in profile.json, 0 when absent); PN the step's prefill chunks (each is its own attention call and
metadata: about 1 ms a chunk on a GPU, where launches dominate; optional too) and PX the pairs between
chunks and the context before them (n * c per chunk; on a GPU a later chunk attends through a gathered
context and a mask, dearer than a fresh prompt's causal flash attention; optional). ``lin`` is piecewise linear over measured token counts (``knots``):
the linear layers' cost is not linear in rows on a CPU (weight-bound at 1 row, compute-bound
at hundreds), so a straight line would be wrong at both ends. Past the last knot it goes on
with the last segment's slope.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

PROFILE_SCHEMA = "pdserve-profile/1"
"""The ``schema`` field of every profile this version reads and writes."""


@dataclass(frozen=True)
class StepFeatures:
    """What one engine step computes, in the units the step model prices."""

    tokens: int = 0
    """T: prefill chunk tokens + one per decoding sequence."""
    sampled: int = 0
    """S: rows that sample a token (decodes and last prefill chunks)."""
    prefill_pairs: float = 0.0
    """PA: query-key pairs of the prefill chunks' attention."""
    decode_ctx: int = 0
    """DC: sum of the decoding sequences' context lengths."""
    prefill_ctx: int = 0
    """PC: keys the prefill chunks' attention reads (c + n per chunk of n tokens after c)."""
    prefill_cached_pairs: float = 0.0
    """PX: of the prefill pairs, those between a chunk's tokens and the c keys before it (n * c per chunk): on a
    GPU a later chunk attends through a gathered context and a materialised mask, dearer per pair than a fresh
    prompt's causal flash attention."""
    prefill_chunks: int = 0
    """PN: prefill chunks in the step (each costs its own attention call and metadata: ~0.6 ms a chunk on a
    GPU, where kernel launches dominate small work)."""


@dataclass
class StepModel:
    """Fitted step costs (see the module docstring)."""

    knots: list[int]
    """Token counts T where ``knot_s`` was fitted, increasing, first >= 1."""
    knot_s: list[float]
    """lin(T) at each knot, seconds."""
    per_sampled_row_s: float = 0.0
    per_prefill_pair_s: float = 0.0
    per_decode_ctx_s: float = 0.0
    per_prefill_ctx_s: float = 0.0
    per_prefill_chunk_s: float = 0.0
    per_prefill_cached_pair_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.knots) < 2 or len(self.knots) != len(self.knot_s):
            raise ValueError("step model: need >= 2 knots and one knot_s per knot")
        if any(b <= a for a, b in zip(self.knots, self.knots[1:])) or self.knots[0] < 1:
            raise ValueError(f"step model: knots must increase from >= 1, got {self.knots}")
        for name in ("per_sampled_row_s", "per_prefill_pair_s", "per_decode_ctx_s", "per_prefill_ctx_s",
                     "per_prefill_chunk_s", "per_prefill_cached_pair_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"step model: {name} must be a finite number >= 0, got {v!r}")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in self.knot_s):
            raise ValueError("step model: knot_s must be finite numbers >= 0")

    def lin(self, tokens: float) -> float:
        """The token term lin(T): linear between knots, extended by the end segments' slopes (>= 0).
        Whole token counts are remembered (a simulation asks for the same few hundred millions of times)."""
        cache = self.__dict__.setdefault("_lin_cache", {})
        hit = cache.get(tokens)
        if hit is not None:
            return hit
        value = self._lin(tokens)
        if type(tokens) is int and len(cache) < 65536:
            cache[tokens] = value
        return value

    def _lin(self, tokens: float) -> float:
        k, y = self.knots, self.knot_s
        if tokens <= 0:
            return 0.0
        i = bisect.bisect_right(k, tokens)
        i = min(max(i, 1), len(k) - 1)
        x0, x1, y0, y1 = k[i - 1], k[i], y[i - 1], y[i]
        return max(0.0, y0 + (y1 - y0) * (tokens - x0) / (x1 - x0))

    def seconds(self, f: StepFeatures) -> float:
        if f.tokens <= 0:
            return 0.0
        return (self.lin(f.tokens) + self.per_sampled_row_s * f.sampled
                + self.per_prefill_pair_s * f.prefill_pairs + self.per_decode_ctx_s * f.decode_ctx
                + self.per_prefill_ctx_s * f.prefill_ctx + self.per_prefill_chunk_s * f.prefill_chunks
                + self.per_prefill_cached_pair_s * f.prefill_cached_pairs)

    def to_dict(self) -> dict[str, Any]:
        return {"knots": list(self.knots), "knot_s": list(self.knot_s), "per_sampled_row_s": self.per_sampled_row_s,
                "per_prefill_pair_s": self.per_prefill_pair_s, "per_decode_ctx_s": self.per_decode_ctx_s,
                "per_prefill_ctx_s": self.per_prefill_ctx_s, "per_prefill_chunk_s": self.per_prefill_chunk_s,
                "per_prefill_cached_pair_s": self.per_prefill_cached_pair_s}


@dataclass
class LinkModel:
    """One KV transport: seconds = latency_s + bytes / bytes_per_s."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass
class CorunModel:
    """How much slower a step runs while sibling workers on the same host run theirs (``pdserve profile``'s co-run
    phase): workers pinned to their own cores still share the memory bus and the last-level cache, and a CPU
    decode step, which streams every weight once, is the first to feel it. Per busy sibling a step of ``d`` solo
    seconds takes ``const_s + ratio * d`` longer; below the shortest measured step (``min_step_s``) the extra
    shrinks in proportion, so tiny steps are never stretched more than the shortest measured one. Measured
    with ``siblings`` busy siblings; more are priced linearly (an extrapolation)."""

    const_s: float
    ratio: float
    min_step_s: float
    siblings: int = 1

    def __post_init__(self) -> None:
        for name in ("const_s", "ratio", "min_step_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"corun: {name} must be a finite number >= 0, got {v!r}")
        if self.min_step_s <= 0:
            raise ValueError("corun: min_step_s must be > 0")
        if not isinstance(self.siblings, int) or self.siblings < 1:
            raise ValueError(f"corun: siblings must be an integer >= 1, got {self.siblings!r}")

    def stretch(self, solo_s: float, busy_siblings: int) -> float:
        """Wall seconds per solo second of a ``solo_s`` step while ``busy_siblings`` siblings step beside it."""
        if busy_siblings <= 0 or solo_s <= 0:
            return 1.0
        extra = (self.const_s + self.ratio * max(solo_s, self.min_step_s)) * min(1.0, solo_s / self.min_step_s)
        return 1.0 + busy_siblings * extra / solo_s

    def to_dict(self) -> dict[str, Any]:
        return {"const_s": self.const_s, "ratio": self.ratio, "min_step_s": self.min_step_s, "siblings": self.siblings}


@dataclass
class Profile:
    """A machine's measured costs for one model configuration (``profile.json``)."""

    model: str
    dtype: str
    quantization: Optional[str]
    kv_cache_dtype: str
    device: str
    threads: Optional[int]
    block_size: int
    num_layers: int
    kv_bytes_per_token: int
    """K and V of every layer for one token, in the cache's dtype: what a transfer ships per prompt token."""
    max_model_len: int
    step: StepModel
    links: dict[str, LinkModel] = field(default_factory=dict)
    """KV transport name ('gloo', 'nccl') -> link model."""
    router_per_request_s: float = 0.0
    """Router work per request that delays its first token (validation, tokenizing, placement, RPC set-up)."""
    router_per_request_pair_s: Optional[float] = None
    """The same for a prefill/decode pair (a Reserve, the Prefill stream, the first token back); None: as
    ``router_per_request_s``."""
    router_per_token_s: float = 0.0
    """Serving-path work per streamed token that delays the token (detokenizing, stop strings, proto, gRPC write)."""
    router_per_step_s: float = 0.0
    """Serving-path work per engine step that streams any token (the loop's pass, one output message per step
    and stream, the wakeups), whatever the number of tokens."""
    router_cpu_per_token_s: float = 0.0
    """CPU seconds the router process (with a client in it, as a load test on the same machine runs) spends per
    streamed token, wherever it runs. Apart from the workers it costs them nothing; on their cores
    (``SimConfig.router_on_worker_cores``) it lengthens each worker step by this much per token the step streams."""
    corun: Optional[CorunModel] = None
    """Steps slowed by sibling workers on the same host (None: not measured; a simulation with several workers per
    host then prices no contention)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Where and how it was measured: pdserve commit and version, torch version, CPU, flags, date, samples."""
    tensor_parallel_size: int = 1
    """Ranks of the measured engine (``pdserve profile --tensor-parallel-size``): its steps are a TP worker's,
    all-reduces included. A simulation prices a pool at TP k with the profile taken at k (``ProfileSet``)."""
    kv_bytes_per_token_rank: Optional[int] = None
    """One rank's KV cache bytes per token (its KV heads; where ranks exceed the KV heads, a replicated head);
    what a rank's cache budget is divided by. None: ``kv_bytes_per_token`` (one rank holds every head)."""
    weight_bytes_per_rank: Optional[int] = None
    """Bytes of one rank's weights in the engine's format (rank 0's shard at TP > 1); with a simulated
    ``rank_memory_bytes`` the KV cache gets what they leave. None: not recorded (an older profile)."""

    SERVING = ("router_per_request_s", "router_per_request_pair_s", "router_per_token_s", "router_per_step_s",
               "router_cpu_per_token_s")
    """The serving path's costs: the host's, whatever the TP or the engine (``serving_costs``)."""

    def serving_costs(self) -> dict[str, Any]:
        """The serving path's costs, to lend another profile (``dataclasses.replace(other, **these)``)."""
        return {name: getattr(self, name) for name in self.SERVING}

    @property
    def rank_kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_rank or self.kv_bytes_per_token

    def step_seconds(self, f: StepFeatures) -> float:
        """One engine step as a worker runs it: the step model plus, when the step streams any token, the
        serving path's ``router_per_step_s`` and ``router_per_token_s`` for each token (the simulator's and the
        SLA planner's one pricing)."""
        s = self.step.seconds(f)
        return s + self.router_per_step_s + self.router_per_token_s * f.sampled if f.sampled else s

    def link(self, name: str) -> LinkModel:
        if name not in self.links:
            raise ValueError(f"profile has no KV link {name!r} (it has {sorted(self.links) or 'none'})")
        return self.links[name]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": PROFILE_SCHEMA, "model": self.model, "dtype": self.dtype, "quantization": self.quantization,
                "kv_cache_dtype": self.kv_cache_dtype, "device": self.device, "threads": self.threads,
                "block_size": self.block_size, "num_layers": self.num_layers,
                "kv_bytes_per_token": self.kv_bytes_per_token, "max_model_len": self.max_model_len,
                "step": self.step.to_dict(),
                "links": {k: {"latency_s": v.latency_s, "bytes_per_s": v.bytes_per_s} for k, v in self.links.items()},
                "router": {"per_request_s": self.router_per_request_s, "per_token_s": self.router_per_token_s,
                           "per_step_s": self.router_per_step_s, "cpu_per_token_s": self.router_cpu_per_token_s,
                           **({} if self.router_per_request_pair_s is None
                              else {"per_request_pair_s": self.router_per_request_pair_s})},
                **({} if self.corun is None else {"corun": self.corun.to_dict()}),
                "tensor_parallel_size": self.tensor_parallel_size,
                **({} if self.kv_bytes_per_token_rank is None else {"kv_bytes_per_token_rank": self.kv_bytes_per_token_rank}),
                **({} if self.weight_bytes_per_rank is None else {"weight_bytes_per_rank": self.weight_bytes_per_rank}),
                "meta": self.meta}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> "Profile":
        """Parse and check; ValueError naming ``where`` and the field."""
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object")
        if d.get("schema") != PROFILE_SCHEMA:
            raise ValueError(f"{where}: schema is {d.get('schema')!r}, this pdserve reads {PROFILE_SCHEMA!r} "
                             "(take a new profile with `pdserve profile`)")
        try:
            step = StepModel(**d["step"])
            links = {str(k): LinkModel(float(v["latency_s"]), float(v["bytes_per_s"]))
                     for k, v in (d.get("links") or {}).items()}
            router = d.get("router") or {}
            p = cls(model=str(d["model"]), dtype=str(d["dtype"]), quantization=d.get("quantization"),
                    kv_cache_dtype=str(d.get("kv_cache_dtype", "auto")), device=str(d.get("device", "cpu")),
                    threads=d.get("threads"), block_size=int(d["block_size"]), num_layers=int(d["num_layers"]),
                    kv_bytes_per_token=int(d["kv_bytes_per_token"]), max_model_len=int(d["max_model_len"]),
                    step=step, links=links, router_per_request_s=float(router.get("per_request_s", 0.0)),
                    router_per_token_s=float(router.get("per_token_s", 0.0)),
                    router_per_step_s=float(router.get("per_step_s", 0.0)), meta=dict(d.get("meta") or {}),
                    router_cpu_per_token_s=float(router.get("cpu_per_token_s", 0.0)),
                    router_per_request_pair_s=(None if router.get("per_request_pair_s") is None
                                               else float(router["per_request_pair_s"])),
                    corun=None if d.get("corun") is None else CorunModel(**d["corun"]),
                    tensor_parallel_size=int(d.get("tensor_parallel_size", 1)),
                    kv_bytes_per_token_rank=(None if d.get("kv_bytes_per_token_rank") is None
                                             else int(d["kv_bytes_per_token_rank"])),
                    weight_bytes_per_rank=(None if d.get("weight_bytes_per_rank") is None
                                           else int(d["weight_bytes_per_rank"])))
        except KeyError as e:
            raise ValueError(f"{where}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        for name in ("block_size", "num_layers", "kv_bytes_per_token", "max_model_len", "tensor_parallel_size",
                     "kv_bytes_per_token_rank", "weight_bytes_per_rank"):
            if getattr(p, name) is not None and getattr(p, name) < 1:
                raise ValueError(f"{where}: {name} must be >= 1, got {getattr(p, name)}")
        for name, link in p.links.items():
            if not (link.latency_s >= 0 and link.bytes_per_s > 0 and math.isfinite(link.bytes_per_s)):
                raise ValueError(f"{where}: links.{name} needs latency_s >= 0 and bytes_per_s > 0")
        if (p.router_per_request_s < 0 or p.router_per_token_s < 0 or p.router_per_step_s < 0
                or p.router_cpu_per_token_s < 0
                or (p.router_per_request_pair_s or 0) < 0):
            raise ValueError(f"{where}: router costs must be >= 0")
        return p

    def check_matches(self, *, model: Optional[str] = None, dtype: Optional[str] = None,
                      quantization: Optional[str] = "", kv_cache_dtype: Optional[str] = None,
                      where: str = "profile") -> None:
        """ValueError when the profile was taken for another configuration than the one simulated."""
        for name, want in (("model", model), ("dtype", dtype), ("kv_cache_dtype", kv_cache_dtype)):
            if want is not None and getattr(self, name) != want:
                raise ValueError(f"{where}: measured {name}={getattr(self, name)!r}, but the run asks for {want!r}; "
                                 f"take a profile with `pdserve profile --{name.replace('_', '-')} {want}`")
        if quantization != "" and self.quantization != quantization:
            raise ValueError(f"{where}: measured quantization={self.quantization!r}, but the run asks for "
                             f"{quantization!r}")


class ProfileSet:
    """Profiles of one model configuration at different tensor-parallel sizes: what prices a deployment whose
    pools run different TP (``SimConfig.pool_tp``).

    Each pool's steps come from the profile taken at its TP (``at``). The serving path (router costs) and the KV
    link are the host's, not the TP's: a profile that did not measure them (``pdserve profile`` measures them at
    TP 1 only) takes them from the set's lowest-TP profile that did. ValueError naming ``where`` for an empty
    set, two profiles at one TP, or profiles of different configurations."""

    SAME = ("model", "dtype", "quantization", "kv_cache_dtype", "device", "block_size", "num_layers")

    def __init__(self, profiles: "list[Profile] | tuple[Profile, ...]", where: str = "--profile") -> None:
        if not profiles:
            raise ValueError(f"{where}: no profile given")
        ordered = sorted(profiles, key=lambda q: q.tensor_parallel_size)
        first = ordered[0]
        for a, b in zip(ordered, ordered[1:]):
            if a.tensor_parallel_size == b.tensor_parallel_size:
                raise ValueError(f"{where}: two profiles at tensor-parallel size {a.tensor_parallel_size} "
                                 "(give one per size)")
        for q in ordered[1:]:
            for name in self.SAME:
                if getattr(q, name) != getattr(first, name):
                    raise ValueError(f"{where}: the profiles differ in {name} ({getattr(first, name)!r} at TP "
                                     f"{first.tensor_parallel_size}, {getattr(q, name)!r} at TP "
                                     f"{q.tensor_parallel_size}): one set prices one model configuration")
        serving = next((q for q in ordered if q.meta.get("router") or q.router_per_request_s), first)
        linked = next((q for q in ordered if q.links), first)
        self.by_tp: dict[int, Profile] = {}
        for q in ordered:
            over: dict[str, Any] = {}
            if q is not serving and not (q.meta.get("router") or q.router_per_request_s):
                over.update(serving.serving_costs())
            if not q.links:
                over["links"] = dict(linked.links)
            self.by_tp[q.tensor_parallel_size] = replace(q, **over) if over else q
        self.where = where

    @property
    def base(self) -> Profile:
        """The lowest-TP profile: the serving path's and the link's costs, the context length, provenance."""
        return self.by_tp[min(self.by_tp)]

    @property
    def sizes(self) -> list[int]:
        return sorted(self.by_tp)

    def at(self, tp: int, flag: str = "--tensor-parallel-size") -> Profile:
        """The profile that prices a worker of ``tp`` ranks; ValueError naming ``flag`` when none was taken."""
        if tp not in self.by_tp:
            raise ValueError(f"{flag} {tp}: no profile at tensor-parallel size {tp} (have "
                             f"{', '.join(map(str, self.sizes))}); take one with `pdserve profile "
                             f"--tensor-parallel-size {tp}` and pass it with another --profile")
        return self.by_tp[tp]

    @classmethod
    def of(cls, profiles: "Profile | ProfileSet") -> "ProfileSet":
        return profiles if isinstance(profiles, ProfileSet) else cls([profiles])


def load_profiles(paths: "str | Path | list[str | Path]") -> ProfileSet:
    """Read one or several ``profile.json`` (one per tensor-parallel size) into a ``ProfileSet``."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    return ProfileSet([load_profile(x) for x in paths], where="--profile " + " ".join(map(str, paths)))


def load_profile(path: str | Path) -> Profile:
    """Read ``profile.json``; ValueError naming the file on any problem."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--profile: no such file {str(p)!r}")
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--profile {p}: not a JSON file ({e})") from None
    prof = Profile.from_dict(d, where=f"--profile {p}")
    from simulator import PDSERVE_VERSION

    made_by = prof.meta.get("pdserve_version")
    if made_by is not None and made_by != PDSERVE_VERSION:
        raise ValueError(f"--profile {p}: taken by pdserve {made_by}, this is {PDSERVE_VERSION}; take a new one")
    return prof


def step_features(sched: Any) -> StepFeatures:
    """The features of an ``engine.scheduler.SchedulerOutput``, read BEFORE the step advances its sequences
    (``num_computed`` is still where the step starts). The profiler and the simulator both price steps
    through this one function, so what is measured is what is simulated."""
    tokens = sched.num_tokens
    sampled = len(sched.decodes)
    pairs = 0.0
    ctx = 0
    keys = 0
    cached = 0
    for seq in sched.decodes:
        ctx += seq.num_computed + 1
    for seq in sched.verifies:
        k = 1 + len(seq.spec_token_ids)
        sampled += k
        ctx += k * (seq.num_computed + 1) + k * (k - 1) // 2
    for seq, n in sched.prefills:
        c = seq.num_computed
        pairs += n * (c + (n + 1) / 2)
        keys += c + n
        cached += n * c
        if c + n == seq.num_tokens:
            sampled += 1
    return StepFeatures(tokens=tokens, sampled=sampled, prefill_pairs=pairs, decode_ctx=ctx, prefill_ctx=keys,
                        prefill_chunks=len(sched.prefills), prefill_cached_pairs=cached)
