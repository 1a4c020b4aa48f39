"""Configuration of the router.

Lifecycle: built by the caller (the cluster, a test), checked once in
``__post_init__`` (``ValueError`` naming the field), read-only afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from transport.ports import check_port

MODES = ("disaggregated", "colocated")


@dataclass
class RouterConfig:
    """Router settings: model (for tokenizer and limits), binding, admission and timeouts."""

    model: str = "tiny"
    """Model the workers serve: "tiny", "bench" or a HF directory (tokenizer and limits come from it)."""
    model_name: Optional[str] = None
    """Name reported to clients and in metrics; None means ``model``."""
    host: str = "127.0.0.1"
    """Interface the public gRPC server binds."""
    port: int = 0
    """Public gRPC port; 0 picks a free one."""
    mode: str = "disaggregated"
    """"disaggregated" (prefill pool + decode pool) or "colocated" (one pool does both)."""
    max_num_requests: int = 192
    """Requests the router holds at once (in progress + waiting for decode KV capacity); more get
    RESOURCE_EXHAUSTED at once. Below ``max_rpc_threads``, so the bound fires before the flow pool runs out of
    threads (a request waiting for KV capacity, placement or its prefill holds one)."""
    queue_timeout_s: float = 300.0
    """Longest a request waits in the router queue for decode KV capacity before RESOURCE_EXHAUSTED."""
    max_new_tokens: Optional[int] = None
    """Largest max_tokens accepted; None means the context length minus one."""
    max_context_length: Optional[int] = None
    """Override the model's context length (prompt + max_tokens); None: the model's."""
    reserve_timeout_s: float = 5.0
    """Deadline of a Reserve call on a decode worker."""
    first_token_timeout_s: float = 60.0
    """Prefill call -> first token (queueing included)."""
    transfer_timeout_s: float = 30.0
    """First token -> prefill worker confirms the KV arrived."""
    request_timeout_s: float = 600.0
    """Whole request, when the client gives no deadline."""
    local_prefill_max_tokens: int = 0
    """Conditional disaggregation (NVIDIA Dynamo's rule), disaggregated mode only: a prompt with at most
    this many tokens to compute is prefilled on the decode worker itself (its colocated ``Generate``), skipping
    the prefill pool and the KV transfer. Tokens to compute: the prompt's, less the leading ones the best-placed
    decode worker holds on the KV event index (with ``decode_prefix_routing``), so a conversation's short next
    turn stays on the decode worker that holds its history. 0 = every prompt goes through the prefill pool."""
    prefill_queue_max_tokens: Optional[int] = None
    """Conditional disaggregation: when even the least-loaded ready prefill worker has at least this many
    prompt tokens queued (reported, plus this router's not yet answered), any prompt is prefilled on the
    decode worker instead. None = never for this reason."""
    prefix_aware_routing: bool = True
    """Send a prompt to the prefill (or colocated) worker this router last sent its longest prefix to,
    where the engine's prefix cache likely still holds it (as SGLang's and llm-d's routers do), unless
    that worker's queue is more than ``prefix_balance_tokens`` prompt tokens longer than the least
    loaded one's."""
    kv_delta_transfers: bool = True
    """Let a decode worker reserve the leading prompt blocks its own prefix cache holds (a conversation's earlier
    turns, which it decoded or received) and have the prefill worker send only the rest (delta transfers, issue 47).
    False: every prompt's whole KV is shipped (the way before)."""
    kv_prefix_fetch_min_tokens: int = 64
    """With ``kv_delta_transfers``: when the decode worker holds at least this many more of the prompt's leading
    tokens than the prefill worker's cache, the prefill worker receives them from it (``DecodeWorker.SendPrefix``)
    instead of computing them, and prefills only what neither side has, while its own measurements say receiving
    them is faster (``prefill_worker.fetch_cost``). 0: the prefill worker computes whatever its own cache lacks."""
    decode_prefix_routing: bool = True
    """Score decode workers, as prefill workers are, by the prompt blocks they hold (the KV event index) against
    their load, so a conversation's turns return to the decode worker that holds its history (with
    ``kv_delta_transfers``, the transfer then carries only the new turn). False: decode workers by load alone."""
    prefix_balance_tokens: int = 2048
    """How much longer a queue (in prompt tokens) prefix-aware routing accepts for a cache hit."""
    output_streams: bool = True
    """Take decode and colocated workers' tokens on one output stream per worker, a message per engine step
    (``router.output_streams``); False: on each request's own call, a message per token (the way before)."""
    one_loop: bool = False
    """Run the HTTP front end on the gRPC front end's event loop and read the workers' output streams there
    (``grpc.aio``), so a flow's streaming stretch runs on that loop and its events reach both front ends without
    a thread hop (docs/router_concurrency.md, "One event loop"). False: today's model (an HTTP loop of its own,
    a reader thread per worker stream). Flows' blocking stretches (placement, prefill, aborts) stay on the
    flow pool either way."""
    kv_events: bool = True
    """Cache-aware routing from the workers' KV events (``router.kv.index``): when the worker list is the Redis
    registry, follow every worker's event stream into one index of what each prefix cache really holds, and score
    prefill/colocated candidates with it (``kv_overlap_weight`` etc.); the router-local mirror
    (``prefix_balance_tokens``' rule) is used only while a candidate's stream is not in sync. False: the mirror only."""
    kv_overlap_weight: float = 1.0
    """Score per leading prompt block a candidate already caches (blocks it will not compute)."""
    kv_load_weight: float = 1.0
    """Score lost per block of prompt tokens queued on a candidate (reported, plus this router's not yet answered):
    with 1.0 a cached block and a queued block weigh the same (prefill work)."""
    kv_request_weight: float = 2.0
    """Score lost per request running, waiting or in flight from this router on a candidate (decode work and
    the heartbeat's lag), in blocks."""
    kv_pending_s: float = 2.0
    """For this long after a prompt is sent to a worker, its blocks count as pending there until the worker's events
    confirm them: held (a burst sharing a new prefix follows the first request instead of spreading cold misses)
    and queued prefill work (the load term: blocks pending on a worker, less those the request shares). 0: the
    events alone (and the worker's reported queue as the load)."""
    otlp_traces_endpoint: Optional[str] = None
    """OpenTelemetry: export a trace of every request (its root span ``llm_request`` and its phases, continued on
    the workers) to this OTLP/gRPC collector (``host:port`` or ``http(s)://host:port``; ``transport.tracing``).
    None: no tracing."""
    kv_replica_sync: bool = True
    """Routers share their placements (``router.kv.replica``: a shared Redis stream ``{ns}:kvplace``), so each
    counts the others' just-placed blocks as pending too, as NVIDIA Dynamo's ``--router-replica-sync``: with several
    routers the next turn of a conversation finds the blocks another router placed a moment ago. Off the request
    path (a bounded queue and a thread); Redis down drops the sharing only (counted). With it, a tie between
    candidates for a prefix cached nowhere is broken through Redis (``router.kv.ties``, one round trip), so routers
    opening new prefixes at the same instant spread. False: own placements only, and each router draws alone."""
    kv_tie_blocks: float = 1.0
    """Candidates scoring within this many blocks of the best are a tie, broken at random, so routers deciding
    at the same instant on the same view spread instead of herding onto one worker. 0: the best, by load order."""
    pool_wait_s: float = 15.0
    """How long a request waits for an empty pool (no live decode, or colocated, worker and no fallback) to get
    a worker back before UNAVAILABLE: the supervisor replaces a dead worker within seconds, so a lone worker's
    crash delays requests instead of failing them. 0: fail at once."""
    max_attempts: int = 2
    """Worker pairs tried for one request; retries happen only before any token reached the client."""
    max_rpc_threads: int = 256
    """Threads of the flow pool: a request holds one while it waits on something that blocks (the admission
    queue, a placement, its prefill, a migration); its token streaming holds none (``router.flow_pump``)."""
    allow_runtime_lora_updating: bool = False
    """Serve ``LoadLoRAAdapter`` / ``UnloadLoRAAdapter`` and vLLM's ``/v1/load_lora_adapter`` /
    ``/v1/unload_lora_adapter`` (router/lora_admin.py); off: UNIMPLEMENTED / 404, as vLLM without
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (a load names a path on the workers' hosts)."""
    lora_resolver_dir: Optional[str] = None
    """With ``allow_runtime_lora_updating``: a request whose ``model`` names no served adapter first loads
    ``lora_resolver_dir/<model>`` on every worker (vLLM's filesystem LoRA resolver, ``VLLM_LORA_RESOLVER_CACHE_DIR``);
    an absolute path on the workers' hosts. None: off."""
    max_loras: Optional[int] = None
    """Most LoRA adapters loaded at run time (the cluster's Redis set; those of ``--lora-modules`` not counted): a load
    beyond it, once loaded, unloads the least recently used other one no request runs under (all in use: the new one
    goes again, RESOURCE_EXHAUSTED). None: no bound. Each router keeps it for its own loads (several routers loading at once may pass it by one
    each)."""
    lora_update_timeout_s: float = 120.0
    """Longest a runtime LoRA load waits for every worker, and an unload for the adapter's requests to finish."""
    responses_store_ttl_s: Optional[float] = None
    """Keep finished Responses API answers (``store``, OpenAI's default) this long, so a request can continue one
    (``previous_response_id``) and ``GET`` / ``DELETE /v1/responses/{id}`` find it (router/response_store.py: in
    the cluster's Redis, shared by every router; in this router's memory with a static worker list). None: off,
    as vLLM's default (each kept response holds its whole conversation)."""
    allow_prefix_cache_reset: bool = False
    """Serve vLLM's ``POST /reset_prefix_cache`` (router/cache_reset.py: every worker forgets its cached prompt
    blocks). Off: 404, as vLLM outside its dev mode (a reset costs every tenant its cache hits)."""
    scheduling_policy: str = "fcfs"
    """vLLM's ``--scheduling-policy``: "fcfs" (requests giving a non-zero ``priority`` are refused, naming it, as
    vLLM's server refuses them) or "priority" (lower ``priority`` first in this router's queue for decode KV
    capacity and in every worker's waiting queue; the worst priority is preempted first). Workers always order by
    priority: only routers let one through."""
    worker_view_refresh_s: float = 0.25
    """How often the router re-reads the worker registry in the background (requests never wait on it)."""
    serve_metrics: bool = True
    """Serve the router's Prometheus /metrics on a free port of ``host``."""
    http_port: Optional[int] = None
    """OpenAI-compatible HTTP API (``router.openai.http_api``) on this port of ``host``; 0 picks a free one;
    None: no HTTP API."""
    health_port: Optional[int] = None
    """A second, plaintext gRPC server on this port of ``host`` offering only ``grpc.health.v1`` (and reflection
    of it), mirroring the public server's status: the kubelet's gRPC probes speak no TLS, so a router serving
    TLS is probed here. 0 picks a free one; None: none."""
    tool_call_parser: Optional[str] = None
    """How the HTTP API reads tool calls out of a free answer (``tool_choice: "auto"``), vLLM's names:
    "hermes" (Hermes/Qwen ``<tool_call>{...}</tool_call>``) or "llama3_json" (``router.openai.tool_parsers``). None:
    requests with tools need ``tool_choice`` "none", "required" or a named function."""
    reasoning_parser: Optional[str] = None
    """vLLM's ``--reasoning-parser``: how the HTTP chat APIs split a thinking model's answer into reasoning and
    content, "deepseek_r1" or "qwen3" (``router.openai.reasoning``); with it, structured outputs constrain the
    answer after the reasoning, and ``thinking_token_budget`` is accepted. None: the answer is all content."""
    default_chat_template_kwargs: Optional[dict] = None
    """vLLM's ``--default-chat-template-kwargs``: extra variables for every chat template render (e.g.
    ``{"enable_thinking": false}``); a request's ``chat_template_kwargs`` override them key by key."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Public API keys: when any is set, every Generate/Tokenize/GetModelInfo call must carry one as
    ``authorization: Bearer <key>`` (UNAUTHENTICATED otherwise); health and reflection stay open."""
    api_keys_file: Optional[str] = None
    """A TOML file of named keys with limits (``transport.api_keys``), re-read when it changes; with it, the
    router accepts its keys (and ``api_keys`` too, unnamed and unlimited) and enforces each name's quota."""
    quota_routers: int = 1
    """Router replicas sharing the deployment's per-key limits: each enforces 1/N of every limit."""
    stream_stall_timeout_s: Optional[float] = 60.0
    """Cut off a streaming client (gRPC stream reset, HTTP connection closed) once one response message has
    waited this long for it to read (``router.stream_stall``); its request is cancelled on the workers. None: never."""
    ssl_certfile: Optional[str] = None
    """PEM certificate chain: serve the public API over TLS (with ``ssl_keyfile``)."""
    ssl_keyfile: Optional[str] = None
    """PEM private key of ``ssl_certfile``."""
    ssl_ca_certs: Optional[str] = None
    """PEM CA bundle: require clients to present a certificate it signed (mutual TLS)."""
    cluster_secret: Optional[str] = field(default=None, repr=False)
    """Presented to the workers on every internal call (their ``WorkerConfig.cluster_secret``)."""
    cluster_tls: Optional[Any] = field(default=None, repr=False)
    """A ``transport.cluster_tls.ClusterTls``: dial the workers over mutual TLS (their ``WorkerConfig.cluster_tls``)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        check_port(self.port, "port")
        check_port(self.http_port, "http_port", allow_none=True)
        check_port(self.health_port, "health_port", allow_none=True)
        if self.stream_stall_timeout_s is not None and not self.stream_stall_timeout_s > 0:
            raise ValueError(f"stream_stall_timeout_s must be > 0 or None, got {self.stream_stall_timeout_s}")
        if self.max_num_requests < 1:
            raise ValueError(f"max_num_requests must be >= 1, got {self.max_num_requests}")
        if self.max_num_requests >= self.max_rpc_threads:
            raise ValueError(f"max_num_requests must be < max_rpc_threads ({self.max_rpc_threads}) so overload is "
                             f"answered before the flow pool's threads run out, got {self.max_num_requests}")
        if not self.pool_wait_s >= 0:
            raise ValueError(f"pool_wait_s must be >= 0, got {self.pool_wait_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_loras is not None and (isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int)
                                           or self.max_loras < 1):
            raise ValueError(f"max_loras must be an integer >= 1 or None, got {self.max_loras!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.responses_store_ttl_s is not None and not 0 < self.responses_store_ttl_s < float("inf"):
            raise ValueError(f"responses_store_ttl_s must be > 0 or None, got {self.responses_store_ttl_s}")
        if self.lora_resolver_dir is not None:
            if not self.allow_runtime_lora_updating:
                raise ValueError("lora_resolver_dir needs allow_runtime_lora_updating (it loads adapters at run time)")
            if not isinstance(self.lora_resolver_dir, str) or not self.lora_resolver_dir.startswith("/"):
                raise ValueError(f"lora_resolver_dir must be an absolute path, got {self.lora_resolver_dir!r}")
        for name in ("worker_view_refresh_s", "queue_timeout_s", "reserve_timeout_s", "first_token_timeout_s", "transfer_timeout_s", "request_timeout_s", "lora_update_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if isinstance(self.local_prefill_max_tokens, bool) or not isinstance(self.local_prefill_max_tokens, int) \
                or self.local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be an int >= 0, got {self.local_prefill_max_tokens!r}")
        if isinstance(self.kv_prefix_fetch_min_tokens, bool) or not isinstance(self.kv_prefix_fetch_min_tokens, int) \
                or self.kv_prefix_fetch_min_tokens < 0:
            raise ValueError(f"kv_prefix_fetch_min_tokens must be an int >= 0, got {self.kv_prefix_fetch_min_tokens!r}")
        if self.prefill_queue_max_tokens is not None and (
                isinstance(self.prefill_queue_max_tokens, bool) or not isinstance(self.prefill_queue_max_tokens, int)
                or self.prefill_queue_max_tokens < 0):
            raise ValueError(f"prefill_queue_max_tokens must be None or an int >= 0, "
                             f"got {self.prefill_queue_max_tokens!r}")
        if self.otlp_traces_endpoint is not None and (not isinstance(self.otlp_traces_endpoint, str)
                                                      or not self.otlp_traces_endpoint.strip()):
            raise ValueError(f"otlp_traces_endpoint must be a host:port or URL, got {self.otlp_traces_endpoint!r}")
        for name in ("kv_delta_transfers", "decode_prefix_routing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.prefix_aware_routing, bool):
            raise ValueError(f"prefix_aware_routing must be a bool, got {self.prefix_aware_routing!r}")
        if isinstance(self.prefix_balance_tokens, bool) or not isinstance(self.prefix_balance_tokens, int) \
                or self.prefix_balance_tokens < 0:
            raise ValueError(f"prefix_balance_tokens must be an int >= 0, got {self.prefix_balance_tokens!r}")
        for name in ("kv_events", "kv_replica_sync", "output_streams", "one_loop"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("kv_overlap_weight", "kv_load_weight", "kv_request_weight", "kv_tie_blocks", "kv_pending_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_context_length is not None and self.max_context_length < 2:
            raise ValueError(f"max_context_length must be >= 2, got {self.max_context_length}")
        from router.openai.tool_parsers import TOOL_CALL_PARSERS

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS} or None, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None:
            from router.openai.reasoning import format_of

            format_of(self.reasoning_parser)  # ValueError naming the known ones
        if self.default_chat_template_kwargs is not None:
            from router.openai.protocol import check_template_kwargs

            self.default_chat_template_kwargs = check_template_kwargs(self.default_chat_template_kwargs,
                                                                      "default_chat_template_kwargs")
        self._check_security()

    def _check_security(self) -> None:
        if isinstance(self.api_keys, str) or not all(isinstance(k, str) and k for k in self.api_keys):
            raise ValueError("api_keys must be a tuple of non-empty strings (their values are not shown)")
        self.api_keys = tuple(self.api_keys)
        if self.api_keys_file is not None and (not isinstance(self.api_keys_file, str) or not self.api_keys_file):
            raise ValueError(f"api_keys_file must be a path, got {self.api_keys_file!r}")
        if isinstance(self.quota_routers, bool) or not isinstance(self.quota_routers, int) or self.quota_routers < 1:
            raise ValueError(f"quota_routers must be an integer >= 1, got {self.quota_routers!r}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile must be given together")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("ssl_ca_certs (mutual TLS) needs ssl_certfile and ssl_keyfile")
        if self.cluster_secret is not None and (not isinstance(self.cluster_secret, str) or
                                                len(self.cluster_secret) < 16):
            raise ValueError("cluster_secret must be a string of at least 16 characters (its value is not shown)")

    @property
    def served_model_name(self) -> str:
        """``model_name``, else the model's built-in name or directory basename (never a path)."""
        from engine import default_served_model_name

        return self.model_name or default_served_model_name(self.model)
