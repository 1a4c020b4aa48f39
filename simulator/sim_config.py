"""The simulation's inputs: ``SimConfig`` (one deployment: pools, engine limits, the router's rules, the link, TP)
and ``SimRequest`` (one request of a workload).

Lifecycle: built by ``pdserve simulate`` / ``plan`` (simulator/cli.py, simulator/plan.py) or a test, validated in
``SimConfig.__post_init__``, then handed to ``simulator.cluster_sim.Simulation``, which never changes them.
``SimConfig.up_flags`` prints the ``pdserve up`` flags that deploy the same configuration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


from engine.config import EngineConfig
from simulator.costs import Profile, ProfileSet

MODES = ("disaggregated", "colocated")
DEFAULT_KV_CACHE_BYTES = EngineConfig.kv_cache_memory_bytes
"""What a worker of ``pdserve up`` gets without --num-kv-blocks: the engine's default budget."""
DEFAULT_MAX_NUM_SEQS = EngineConfig.max_num_seqs


@dataclass
class SimConfig:
    """One deployment, spelled as ``pdserve up`` spells it."""

    mode: str = "disaggregated"
    """'disaggregated' (prefill + decode pools) or 'colocated'."""
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    """Workers per pool (colocated mode uses ``colocated``)."""
    max_num_batched_tokens: int = 2048
    """Every engine's per-step token budget (the chunk size of chunked prefill)."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    num_kv_blocks: Optional[int] = None
    """KV blocks per worker; None: ``kv_cache_memory_bytes`` over the profile's bytes per block."""
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    enable_prefix_caching: bool = True
    prefix_aware_routing: bool = True
    kv_delta_transfers: bool = True
    """The router's rule (issue 47): a decode reservation takes the prompt's leading blocks the decode worker's cache
    holds and only the rest is transferred (and priced on the link)."""
    kv_prefix_fetch_min_tokens: int = 64
    """The router's rule (issue 47, with ``kv_delta_transfers``): a prefill worker holding at least this many fewer of
    the prompt's leading tokens than its decode worker's reservation found receives them from it (priced on the link)
    and computes only the rest. 0: it computes whatever its own cache lacks."""
    decode_prefix_routing: bool = True
    """The router's rule: decode workers ranked by the prompt blocks they hold against their load."""
    kv_events: bool = True
    """The router scores prefixes on its KV-event index, as a deployed router does by default: every simulated
    engine's prefix-cache events (``BlockManager.enable_events``) reach the router's own ``KVIndex`` at the end of
    the step (or the command) that made them, and the router's placements count as pending there for
    ``kv_pending_s``. False (``pdserve router --no-kv-events``): on its mirror of where it sent what."""
    local_prefill_max_tokens: int = 0
    prefill_queue_max_tokens: Optional[int] = None
    max_num_requests: int = 192
    queue_timeout_s: float = 300.0
    kv_link: str = "gloo"
    router_on_worker_cores: bool = False
    """The router process (and the clients beside it) runs on the workers' cores, as ``pdserve up`` and a load test
    on one machine do: every worker step is lengthened by the profile's ``router_cpu_per_token_s`` per token it
    streams (the router's CPU per token comes out of some worker's core; charged to the one whose token it is).
    False (the default): the router runs apart and only its latency counts."""
    workers_per_host: int = 1
    """Workers sharing one host's memory system, in creation order (one core or GPU each). Above 1 a step is
    slowed while its host's other workers run theirs, by the profile's co-run model (``Profile.corun``); 1 (the
    default, each worker alone on its host) prices no contention."""
    tensor_parallel_size: int = 1
    """Ranks of every worker (``pdserve up --tensor-parallel-size``); ``prefill_tp`` / ``decode_tp`` set a pool
    apart. A pool at TP k is priced by the profile taken at k (``simulator.costs.ProfileSet``), its KV blocks
    are each rank's budget over one rank's bytes per block, and a transfer between TP p and TP d runs on
    min(p, d) rank pairs at once (each source rank sends its heads, each destination rank receives its own)."""
    prefill_tp: Optional[int] = None
    decode_tp: Optional[int] = None
    rank_memory_bytes: Optional[int] = None
    """Memory of one rank (a GPU, or a process's share of a host) for its weights and KV cache: the cache gets
    what the profile's ``weight_bytes_per_rank`` leaves (the reason a model needs TP at all). None: the cache
    is ``kv_cache_memory_bytes`` per rank whatever the weights."""
    seed: int = 0
    """Seeds the router's random draws (ties between equally good workers): the same seed, configuration and
    requests give the same simulation, so two runs of one command line agree and a test's numbers are fixed."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("prefill", "decode", "colocated"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"--{name} must be an integer >= 0, got {v!r}")
        if self.mode == "colocated" and self.colocated < 1:
            raise ValueError("--colocated must be >= 1 in colocated mode (a budget of 0 workers serves nothing)")
        if self.mode == "disaggregated" and (self.prefill < 1 or self.decode < 1):
            raise ValueError("disaggregated mode needs --prefill >= 1 and --decode >= 1")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_num_requests"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}")
        if not isinstance(self.kv_prefix_fetch_min_tokens, int) or self.kv_prefix_fetch_min_tokens < 0:
            raise ValueError(f"--kv-prefix-fetch-min-tokens must be an integer >= 0, "
                             f"got {self.kv_prefix_fetch_min_tokens!r}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if not isinstance(self.router_on_worker_cores, bool):
            raise ValueError(f"router_on_worker_cores must be a bool, got {self.router_on_worker_cores!r}")
        if not isinstance(self.workers_per_host, int) or self.workers_per_host < 1:
            raise ValueError(f"--workers-per-host must be an integer >= 1, got {self.workers_per_host!r}")
        for flag, v in (("--tensor-parallel-size", self.tensor_parallel_size), ("--prefill-tp", self.prefill_tp),
                        ("--decode-tp", self.decode_tp)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{flag} must be an integer >= 1, got {v!r}")
        if self.workers_per_host > 1 and any(self.pool_tp(r) > 1 for r in self.roles):
            raise ValueError("--workers-per-host > 1 prices one-rank workers sharing a host; with tensor "
                             "parallelism a worker is several ranks (co-running of TP workers is not modelled)")
        if self.rank_memory_bytes is not None and self.rank_memory_bytes < 1:
            raise ValueError(f"--rank-memory-bytes must be >= 1, got {self.rank_memory_bytes}")

    @property
    def roles(self) -> tuple[str, ...]:
        return ("colocated",) if self.mode == "colocated" else ("prefill", "decode")

    def pool_tp(self, role: str) -> int:
        """Ranks of each worker of ``role``'s pool (``cluster.config.pool_tp``'s rule)."""
        own = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role)
        return own if own is not None else self.tensor_parallel_size

    def pool_size(self, role: str) -> int:
        return {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[role]

    @property
    def num_ranks(self) -> int:
        """Engine ranks (cores or GPUs) of the deployment: a worker at TP k counts k. ``pdserve plan``'s budget."""
        return sum(self.pool_size(r) * self.pool_tp(r) for r in self.roles)

    def tp_flag(self, role: str) -> str:
        """The flag that sets ``role``'s TP, for messages."""
        own = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role)
        return f"--{role}-tp" if own is not None else "--tensor-parallel-size"

    @property
    def num_workers(self) -> int:
        return self.colocated if self.mode == "colocated" else self.prefill + self.decode

    def _tp_label(self, role: str) -> str:
        return f"(TP{self.pool_tp(role)})" if any(self.pool_tp(r) > 1 for r in self.roles) else ""

    def label(self) -> str:
        if self.mode == "colocated":
            return f"colocated {self.colocated}{self._tp_label('colocated')} (chunk {self.max_num_batched_tokens})"
        cd = f", local<={self.local_prefill_max_tokens}" if self.local_prefill_max_tokens else ""
        if self.prefill_queue_max_tokens is not None:
            cd += f", backlog>={self.prefill_queue_max_tokens}"
        return (f"disaggregated {self.prefill}P{self._tp_label('prefill')}+{self.decode}D{self._tp_label('decode')} "
                f"(chunk {self.max_num_batched_tokens}{cd})")

    def kv_blocks(self, profile: Profile) -> int:
        """KV blocks per worker priced by ``profile`` (the one at the pool's TP): ``num_kv_blocks``, or each
        rank's cache budget over one rank's bytes per block (every rank holds the same block ids, its heads of
        them). The budget is ``kv_cache_memory_bytes``, or, with ``rank_memory_bytes``, what the rank's weights
        leave of it."""
        if self.num_kv_blocks:
            return self.num_kv_blocks
        per_block = profile.rank_kv_bytes_per_token * profile.block_size
        budget, flag = self.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
        if self.rank_memory_bytes is not None:
            if profile.weight_bytes_per_rank is None:
                raise ValueError(f"--rank-memory-bytes needs the profile's weight_bytes_per_rank (TP "
                                 f"{profile.tensor_parallel_size}: take the profile again with this pdserve)")
            budget = self.rank_memory_bytes - profile.weight_bytes_per_rank
            flag = f"--rank-memory-bytes {self.rank_memory_bytes} at TP {profile.tensor_parallel_size}"
            if budget < per_block:
                raise ValueError(f"{flag}: a rank's weights ({profile.weight_bytes_per_rank} B) leave no room "
                                 f"for a KV block of {per_block} B (the model needs more tensor parallelism)")
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(f"{flag} {budget} holds no KV block of {per_block} bytes")
        return blocks

    def fits(self, profile: Profile) -> bool:
        """Whether a worker priced by ``profile`` has room for at least one KV block (``kv_blocks`` succeeds)."""
        try:
            self.kv_blocks(profile)
        except ValueError:
            return False
        return True

    def up_flags(self, profile: "Profile | ProfileSet") -> str:
        """The ``pdserve up`` flags that run this deployment (``pdserve up`` sizes KV by blocks: a cache budget
        other than the engine's default becomes ``--num-kv-blocks``, or each pool's where their TP differs).
        ``profile``: a ``Profile`` or a ``ProfileSet`` (one per TP the pools run)."""
        profiles = ProfileSet.of(profile)
        if self.mode == "colocated":
            f = f"--colocated {self.colocated}"
        else:
            f = f"--prefill {self.prefill} --decode {self.decode}"
            if self.local_prefill_max_tokens:
                f += f" --local-prefill-max-tokens {self.local_prefill_max_tokens}"
            if self.prefill_queue_max_tokens is not None:
                f += f" --prefill-queue-max-tokens {self.prefill_queue_max_tokens}"
            if not self.kv_delta_transfers:
                f += " --no-kv-delta-transfers"
            elif self.kv_prefix_fetch_min_tokens != 64:
                f += f" --kv-prefix-fetch-min-tokens {self.kv_prefix_fetch_min_tokens}"
            if not self.decode_prefix_routing:
                f += " --no-decode-prefix-routing"
        if not self.kv_events:
            f += " --no-kv-events"
        tps = {r: self.pool_tp(r) for r in self.roles}
        if len(set(tps.values())) == 1:
            tp = next(iter(tps.values()))
            f += f" --tensor-parallel-size {tp}" if tp > 1 else ""
        else:
            f += f" --prefill-tp {tps['prefill']} --decode-tp {tps['decode']}"
        f += f" --max-num-batched-tokens {self.max_num_batched_tokens}"
        if (self.num_kv_blocks is not None or self.kv_cache_memory_bytes != DEFAULT_KV_CACHE_BYTES
                or self.rank_memory_bytes is not None):
            blocks = {r: self.kv_blocks(profiles.at(t)) for r, t in tps.items()}
            if len(set(blocks.values())) == 1:
                f += f" --num-kv-blocks {next(iter(blocks.values()))}"
            else:  # pools at different TP hold different blocks in the same memory
                f += f" --prefill-num-kv-blocks {blocks['prefill']} --decode-num-kv-blocks {blocks['decode']}"
        if self.max_num_seqs != DEFAULT_MAX_NUM_SEQS:
            f += f" --max-num-seqs {self.max_num_seqs}"
        if not self.enable_prefix_caching:
            f += " --no-prefix-caching"
        return f


@dataclass
class SimRequest:
    """One request of a simulated workload."""

    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int
