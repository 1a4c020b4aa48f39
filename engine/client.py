"""The engine as its workers see it: the contract, written down as two protocols.

Lifecycle: nothing here runs. A worker builds its engine once (``worker_common.worker_base``): an ``LLMEngine`` in
its own process, or, for a worker with ``engine_process`` (any role), a ``worker_common.engine_process.RemoteEngine``
proxying one in a child process. The worker's request sets and its loop then use only the members below, which
``tests/engine/test_client.py`` checks both implementations have:

- ``EngineCore``: what every role uses: requests in (``add_request``, ``abort_request``), outputs out
  (``step_result()``: one ``StepResult`` of outputs, ``EngineLoad`` and prefix-cache events; ``step()``, the outputs
  alone, stays for the offline API, tests and benchmarks), its load and capacity (``load()``, the ``num_*`` counts,
  ``make_stats``), the prefix cache's events between steps (``block_manager``: ``enable_caching``,
  ``enable_events``, ``take_events``: what commands record while no step runs) and the layer hook. Both
  implementations have it.
- ``KVEngine``: what the prefill and decode roles use beyond that: the KV cache itself (the tensors a KV transfer
  reads and writes, ``kv_caches``; block tables; reservations of blocks for KV that arrives from another worker and
  naming received blocks in the prefix cache). Both implementations have it: ``RemoteEngine(kv=True)`` maps the
  child's cache (shared memory, CPU) and answers the rest by calls into the child.

An in-process engine also has ``owner_lock`` (the worker loop's lock, let go around the model's forward so a
decode worker's ``Reserve`` runs beside it: ``EngineLoop.beside``); an engine without it is stepped and called from
the loop thread alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable


@dataclass(frozen=True)
class EngineLoad:
    """The engine's load at one moment: what its worker reports (registry, load metrics, the stall watch)."""

    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    stats: Any
    """``engine.stats.SchedulerStats``: the state and running totals (``make_stats()``)."""


@dataclass(frozen=True)
class StepResult:
    """What one ``step_result()`` hands its worker: the step's outputs, the load after it, and the prefix cache's
    events recorded up to its end (empty unless ``block_manager.enable_events()``), in one object."""

    outputs: list
    """``engine.outputs.CoreOutput`` of the step, in order."""
    load: EngineLoad
    events: list = field(default_factory=list)


@runtime_checkable
class PrefixCacheEvents(Protocol):
    """The prefix cache's side a worker uses (``engine.block_manager``): whether it caches, and its events."""

    enable_caching: bool

    def enable_events(self) -> None: ...

    def take_events(self) -> list[tuple]: ...


@runtime_checkable
class EngineCore(Protocol):
    """What every worker role uses of its engine (see module docstring)."""

    block_manager: Any
    """A ``PrefixCacheEvents``."""
    layer_done_callback: Optional[Callable[..., None]]
    """Called from inside ``step()`` as prompts' layers complete (``RemoteEngine``: once, at their first layer)."""

    @property
    def block_size(self) -> int: ...

    @property
    def kv_cache_dtype(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_total_blocks(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any, **kw: Any) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list: ...

    def step_result(self) -> StepResult:
        """One step as the worker's loop runs it: ``step()``'s outputs, ``load()`` after it, the events taken."""
        ...

    def load(self) -> EngineLoad: ...

    def make_stats(self) -> Any: ...

    def add_lora(self, name: str, path: str) -> int:
        """Load a LoRA adapter and serve it as ``name``; its prefix-cache root (engine/lora.py)."""
        ...

    def remove_lora(self, name: str) -> int:
        """Stop serving adapter ``name``; how many requests still run under it."""
        ...

    def lora_adapters(self) -> dict[str, int]:
        """The adapters served, name -> prefix-cache root."""
        ...

    def lora_event_ids(self) -> dict[int, int]:
        """Every adapter's prefix-cache root -> its KV events' ``lora_id``."""
        ...

    def reset_prefix_cache(self) -> tuple[bool, int]:
        """Forget every cached prompt block: ``(True, 0)``, or ``(False, blocks held)`` while requests hold any."""
        ...


@runtime_checkable
class KVEngine(EngineCore, Protocol):
    """What the prefill and decode roles use beyond ``EngineCore``: the KV cache (see module docstring)."""

    kv_caches: list
    """Per layer, the (k, v) cache tensors a KV transfer reads from and writes into."""

    def has_request(self, request_id: str) -> bool: ...

    def release(self, request_id: str) -> None: ...

    def check_request(self, request_id: str, prompt_token_ids: list[int], params: Any, *,
                      prefill_only: bool = False) -> None: ...

    def get_block_table(self, request_id: str) -> list[int]: ...

    def reserve_prompt(self, request_id: str, num_tokens: int, prompt_token_ids: Optional[list[int]] = None, *,
                       prefix: bool = False, lora_name: Optional[str] = None,
                       cache_salt: Optional[str] = None) -> Optional[tuple[list[int], int]]: ...

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], first_token_id: int, params: Any,
                              first_logprob: Any = None) -> None: ...

    def cached_prefix_tokens(self, prompt_token_ids: list[int], lora_name: Optional[str] = None,
                             cache_salt: Optional[str] = None) -> int: ...

    def commit_reserved(self, request_id: str, prompt_token_ids: list[int]) -> int: ...
