"""Cluster configuration, and how it becomes role objects and a router.

Lifecycle: the caller (``pdserve up``, a test) builds a ``ClusterConfig``; it is
validated once in ``__post_init__`` (``ValueError`` naming the field) and then
read-only. ``Cluster`` ships a copy (without the factories) to every worker
actor, where ``build_role_worker`` turns it into a ``PrefillWorker`` /
``DecodeWorker`` / ``ColocatedWorker``; ``build_router`` makes the router in
the launcher process.

Secrets (``api_keys``, ``cluster_secret``) travel inside the config objects Ray
pickles to the actors, never on a command line, and are kept out of ``repr``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from cluster.registry import Registry
from transport.ports import check_port

POOLS = ("prefill", "decode", "colocated")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ClusterConfig:
    """How to run one cluster."""

    model: str = "tiny"
    """Model every worker serves: "tiny", "bench" or a Hugging Face directory."""
    served_model_name: Optional[str] = None
    """The model's name to clients (/v1/models, ModelInfo, the ``model`` field they send) and in every
    component's metric labels and registry record; None: ``model``'s last path component (the built-in
    name, or the model directory's basename), never a filesystem path."""
    num_prefill: int = 1
    """Prefill workers at start."""
    num_decode: int = 1
    """Decode workers at start."""
    num_colocated: int = 0
    """Colocated workers (prefill and decode in one engine); > 0 runs the router in colocated mode."""
    host: str = "127.0.0.1"
    """Interface every listener of this process binds (router gRPC and metrics, the embedded Redis) and, on a
    local Ray, the workers' too (gRPC, metrics, gloo). Multi-node: this node's own address. A wildcard
    ("0.0.0.0", "::") only when given explicitly."""
    router_host: Optional[str] = None
    """Interface of the public gRPC server (and the router's metrics); None: ``host``."""
    router_port: int = 0
    """Public gRPC port; 0 picks a free one."""
    redis_url: Optional[str] = field(default=None, repr=False)
    """External Redis (``redis://:PASSWORD@host:port/db``, ``rediss://`` for TLS); None starts a private
    embedded one with a generated password. Kept out of repr (it may carry the password)."""
    ray_address: Optional[str] = None
    """Ray to join ("auto", "host:port", "ray://..."); None uses this process's Ray or starts a local one."""
    namespace: Optional[str] = None
    """Registry/kvtransfer namespace; None makes a unique one. Must be unique per cluster: stop() deletes its keys."""
    worker_host: Optional[str] = None
    """Interface workers bind (gRPC, metrics, gloo); None: ``host`` on a local Ray, the Ray node IP of each
    worker's node on a joined one."""
    cpus_per_worker: float = 1.0
    """Ray CPUs per worker actor (also its torch thread count)."""
    gpus_per_worker: float = 1.0
    """Ray GPUs per worker actor on a CUDA deployment, in (0, 1]: below 1 several workers share a GPU (Ray gives them
    the same device), e.g. 0.5 for one prefill and one decode worker on one GPU, each with its own
    ``kv_cache_memory_bytes``; their KV then moves over CUDA IPC (NCCL refuses two ranks on one device)."""
    ray_num_cpus: Optional[int] = None
    """Logical CPUs of a locally started Ray; None: enough for the pools plus headroom to scale."""
    engine_overrides: dict = field(default_factory=dict)
    """Extra engine.config.EngineConfig fields for every worker (e.g. num_kv_blocks, max_num_seqs)."""
    pool_tensor_parallel: dict = field(default_factory=dict)
    """Role ("prefill", "decode") -> ranks each of its workers' engines is split over, where a pool differs from
    ``engine_overrides``' ``tensor_parallel_size`` (``--prefill-tp``, ``--decode-tp``)."""
    pool_num_kv_blocks: dict = field(default_factory=dict)
    """Role -> KV blocks of each of its workers, where a pool differs from ``engine_overrides``' ``num_kv_blocks``
    (``--prefill-num-kv-blocks``, ``--decode-num-kv-blocks``: pools at different TP hold different blocks in the
    same memory; ``pdserve plan`` recommends them)."""
    router_overrides: dict = field(default_factory=dict)
    """Extra router.config.RouterConfig fields."""
    otlp_traces_endpoint: Optional[str] = None
    """OpenTelemetry collector every worker exports its request spans to (the router's is in ``router_overrides``;
    ``--otlp-traces-endpoint`` sets both)."""
    ttl_s: float = 3.0
    """Registry TTL: a silent worker leaves routing after this long."""
    heartbeat_interval_s: float = 1.0
    """Seconds between worker heartbeats."""
    start_timeout_s: float = 300.0
    """Deadline for a worker actor to be placed, load its model and register."""
    drain_timeout_s: float = 30.0
    """How long a removed worker may take to finish its in-flight requests."""
    worker_factory: Optional[Callable[..., Any]] = None
    """Role builder ``(role, worker_id, cfg, node_ip, node_id) -> RoleWorker``; None builds the real roles."""
    router_factory: Optional[Callable[..., Any]] = None
    """Router builder ``(cfg, registry) -> router`` with start()/stop()/address; None builds router.RouterServer.
    Pass ``False`` for no router (pool-only tests)."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Public API keys (router.RouterConfig.api_keys): none = the public API is open."""
    ssl_certfile: Optional[str] = None
    """PEM certificate chain: the router serves TLS (with ``ssl_keyfile``)."""
    ssl_keyfile: Optional[str] = None
    """PEM key of ``ssl_certfile``."""
    ssl_ca_certs: Optional[str] = None
    """PEM CA bundle: the router requires client certificates it signed (mutual TLS)."""
    cluster_secret: Optional[str] = field(default=None, repr=False)
    """Shared secret of the cluster plane: the router presents it on every call to a worker, which refuses
    calls without it. None: ``Cluster`` generates one (``secrets.token_urlsafe(32)``). Give the same one to
    every process of a cluster that spans several launchers."""
    cluster_tls: Optional[Any] = field(default=None, repr=False)
    """A ``transport.cluster_tls.ClusterTls``: the cluster plane (router -> workers) runs over mutual TLS with it.
    None: plaintext behind the cluster secret."""
    detached: bool = False
    """Workers are detached, named Ray actors of the deployment (``namespace``, also their Ray namespace): they
    outlive this process. ``start()`` takes the deployment's controller lease (``cluster.ownership``) and
    adopts the live workers an earlier controller started; ``stop()`` leaves them serving (``teardown()`` stops
    them). Needs a ``namespace`` and a Ray that outlives this process (``ray_address``, or a Ray this process
    already joined). ``pdserve controller`` runs this way."""
    device: str = "auto"
    """"cpu", "cuda", or "auto" (cuda when the Ray cluster offers GPUs, else cpu). On cuda every worker actor
    asks Ray for one GPU, its engine runs there and KV moves over NCCL."""
    kv_shm: bool = True
    """Workers on one host move KV through shared memory instead of the loopback socket (``WorkerConfig.kv_shm``;
    gloo only: on cuda KV moves over NCCL)."""
    engine_process: bool = False
    """Every worker runs its engine core in a process of its own (``WorkerConfig.engine_process``); the worker
    actor's gRPC and streaming threads then use CPU beyond ``cpus_per_worker``. The prefill and decode pools' engine
    processes keep their KV cache in shared memory the worker maps: CPU only."""

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode", "num_colocated"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        check_port(self.router_port, "router_port")
        if not isinstance(self.engine_process, bool):
            raise ValueError(f"engine_process must be a bool, got {self.engine_process!r}")
        if not isinstance(self.kv_shm, bool):
            raise ValueError(f"kv_shm must be a bool, got {self.kv_shm!r}")
        if self.engine_process and self.device == "cuda" and (self.num_prefill or self.num_decode):
            raise ValueError("engine_process with prefill or decode pools needs device cpu: their engine process "
                             "shares its KV cache with the worker through shared memory (a CUDA cache is not shared "
                             "between the engine process and its worker)")
        if not self.cpus_per_worker > 0:
            raise ValueError(f"cpus_per_worker must be > 0, got {self.cpus_per_worker!r}")
        g = self.gpus_per_worker
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1:
            raise ValueError(f"gpus_per_worker must be in (0, 1], got {g!r}")
        for name in ("pool_tensor_parallel", "pool_num_kv_blocks"):
            for role, n in getattr(self, name).items():
                if role not in ("prefill", "decode", "colocated"):
                    raise ValueError(f"{name}: unknown role {role!r}")
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise ValueError(f"{name}[{role!r}] must be an integer >= 1, got {n!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if self.served_model_name is None:
            from engine.names import default_served_model_name

            self.served_model_name = default_served_model_name(self.model)
        if not isinstance(self.served_model_name, str) or not self.served_model_name.strip() \
                or not self.served_model_name.isprintable():
            raise ValueError(f"served_model_name must be a non-empty printable string, got "
                             f"{self.served_model_name!r}")
        if self.ray_num_cpus is not None and self.ray_num_cpus < 1:
            raise ValueError(f"ray_num_cpus must be >= 1, got {self.ray_num_cpus!r}")
        if not (0 < self.heartbeat_interval_s < self.ttl_s):
            raise ValueError(f"heartbeat_interval_s must be in (0, ttl_s), got {self.heartbeat_interval_s!r}")
        for name in ("start_timeout_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be an interface address, got {self.host!r}")
        if isinstance(self.api_keys, str) or not all(isinstance(k, str) and k for k in self.api_keys):
            raise ValueError("api_keys must be a tuple of non-empty strings (their values are not shown)")
        self.api_keys = tuple(self.api_keys)
        if self.cluster_secret is not None and (not isinstance(self.cluster_secret, str)
                                                or len(self.cluster_secret) < 16):
            raise ValueError("cluster_secret must be a string of at least 16 characters (its value is not shown)")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.detached and not self.namespace:
            raise ValueError("namespace must be set when detached is true (it names the deployment whose workers "
                             "outlive this process)")
        if self.num_colocated and (self.num_prefill or self.num_decode):
            raise ValueError("num_colocated must be 0 when num_prefill or num_decode is set "
                             "(the router runs one mode: disaggregated or colocated)")

    @property
    def mode(self) -> str:
        """The router's mode: "colocated" when the cluster runs colocated workers, else "disaggregated"."""
        return "colocated" if self.num_colocated else "disaggregated"


def resolve_device(device: str, num_gpus: float) -> str:
    """The device the workers use: ``device``, with "auto" = "cuda" when the Ray cluster offers GPUs
    (``num_gpus`` > 0, from ``ray.cluster_resources()``), else "cpu". ValueError for "cuda" without GPUs."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        return "cuda" if num_gpus > 0 else "cpu"
    if device == "cuda" and not num_gpus > 0:
        raise ValueError("device is 'cuda' but the Ray cluster offers no GPU (ray.cluster_resources() has no "
                         "'GPU'); use device 'cpu' or join a Ray cluster with GPU nodes")
    return device


WORKER_METRICS_PORT_ENV = "PDSERVE_WORKER_METRICS_PORT"
"""Set on a node (a Kubernetes pod) that runs one worker: that worker serves /metrics on this fixed port."""


def worker_metrics_port(environ: Optional[dict] = None) -> int:
    """The fixed worker /metrics port from ``PDSERVE_WORKER_METRICS_PORT`` (read inside the actor, on its
    node); 0 (a free port) when unset. ValueError naming the variable when it is not a port."""
    raw = (os.environ if environ is None else environ).get(WORKER_METRICS_PORT_ENV, "").strip()
    if not raw:
        return 0
    return check_port(int(raw) if raw.isdigit() else raw, WORKER_METRICS_PORT_ENV, allow_zero=False)


def pool_tp(cfg: "ClusterConfig", role: str) -> int:
    """Ranks each worker of ``role``'s pool runs its engine on (its actor reserves their CPUs)."""
    return int(cfg.pool_tensor_parallel.get(role, cfg.engine_overrides.get("tensor_parallel_size", 1)))


def auto_dtype(cuda: bool) -> str:
    """``pdserve up --dtype auto``: float32 on CPU (pdserve's CPU kernels are built for it); on CUDA bfloat16, what
    the GPU engine's kernels and benchmarks are built and measured for, or float16 on a GPU without bfloat16
    (before Ampere). Call on the worker's node (it asks its GPU)."""
    if not cuda:
        return "float32"
    import torch

    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def build_role_worker(role: str, worker_id: str, cfg: ClusterConfig, kv_store: Any,
                      node_ip: str, node_id: str) -> Any:
    """The real prefill/decode role object for one actor (runs inside the actor)."""
    from engine.config import EngineConfig
    from kvtransfer import StoreConfig

    host = cfg.worker_host or (cfg.host if cfg.ray_address is None else node_ip)
    cuda = cfg.device == "cuda"  # resolved by Cluster.start(); Ray gave this actor one GPU (cuda:0 here)
    overrides = dict(cfg.engine_overrides)
    if role == "prefill":
        overrides.pop("speculative_config", None)  # prefill workers never decode: no drafts, no draft model
        overrides.pop("cuda_graph_sizes", None)
        overrides.pop("cuda_graph_token_sizes", None)
        overrides.pop("async_scheduling", None)  # it runs decode steps ahead, and needs the graphs
        overrides["enforce_eager"] = True  # nor decode graphs: their capture would only take time and memory
    overrides["tensor_parallel_size"] = pool_tp(cfg, role)
    overrides.setdefault("dtype", auto_dtype(cuda))
    if role in cfg.pool_num_kv_blocks:
        overrides["num_kv_blocks"] = cfg.pool_num_kv_blocks[role]
    if role == "prefill" and cfg.kv_shm and overrides["tensor_parallel_size"] == 1:
        # a same-host decode worker reads this worker's KV in place (kvtransfer/shm.py's pull; on CUDA over CUDA
        # IPC, the cache one device allocation). The decode worker's own CPU cache stays private: shared memory
        # gets no transparent huge pages here (tmpfs), and its decode steps read the whole cache; the prefix fetch
        # it sends goes through the ring instead
        overrides.setdefault("kv_cache_shared", True)
    engine = EngineConfig(model=cfg.model, num_threads=max(1, int(cfg.cpus_per_worker)),
                          **{"device": "cuda" if cuda else "cpu", **overrides})
    if isinstance(kv_store, StoreConfig):  # gloo listens on the worker's interface, not the hostname's
        kv_store = dataclasses.replace(kv_store, host=host)
    common = dict(worker_id=worker_id, engine=engine, kv_store=kv_store, host=host, node_id=node_id,
                  cluster_secret=cfg.cluster_secret, cluster_tls=cfg.cluster_tls, model_name=cfg.served_model_name,
                  metrics_port=worker_metrics_port(), kv_backend="nccl" if cuda else "gloo", kv_shm=cfg.kv_shm,
                  otlp_traces_endpoint=cfg.otlp_traces_endpoint, engine_process=cfg.engine_process)
    if isinstance(kv_store, StoreConfig) and kv_store.url.startswith(("redis://", "rediss://", "unix://")):
        # KV events go to the cluster's Redis under its namespace (the rendezvous is "{namespace}:kvt")
        common.update(kv_events_url=kv_store.url, kv_events_namespace=kv_store.namespace.removesuffix(":kvt"))
    if role == "prefill":
        from prefill_worker import PrefillWorker, PrefillWorkerConfig

        return PrefillWorker(PrefillWorkerConfig(**common))
    if role == "decode":
        from decode_worker import DecodeWorker, DecodeWorkerConfig

        return DecodeWorker(DecodeWorkerConfig(**common))
    if role == "colocated":
        from decode_worker import ColocatedWorker, ColocatedWorkerConfig

        common.pop("kv_store")  # one engine does both phases: no KV moves
        return ColocatedWorker(ColocatedWorkerConfig(**common))
    raise ValueError(f"role must be one of {POOLS}, got {role!r}")


def build_router(cfg: ClusterConfig, registry: Registry) -> Any:
    """The real router, reading worker pools from ``registry``."""
    from router import RouterConfig, RouterServer

    security = dict(api_keys=cfg.api_keys, ssl_certfile=cfg.ssl_certfile, ssl_keyfile=cfg.ssl_keyfile,
                    ssl_ca_certs=cfg.ssl_ca_certs, cluster_secret=cfg.cluster_secret, cluster_tls=cfg.cluster_tls)
    rcfg = RouterConfig(model=cfg.model, host=cfg.router_host or cfg.host, port=cfg.router_port, mode=cfg.mode,
                        **{"model_name": cfg.served_model_name, **security, **cfg.router_overrides})
    return RouterServer(rcfg, registry)
