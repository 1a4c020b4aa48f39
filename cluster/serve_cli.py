"""The serving commands of ``pdserve``: ``up`` (all in one), ``controller`` and ``router`` (split).

``pdserve up`` runs a whole cluster in one process: parse flags ->
``Cluster.start()`` (Redis, Ray, pools, router) -> wait until the router's
grpc.health says SERVING -> print the endpoints -> block until SIGINT/SIGTERM ->
``Cluster.stop()`` stops every process it started and deletes its Redis keys ->
exit 0. It always runs a ``Supervisor`` (dead or stuck workers are replaced
under new ids) and with ``--autoscale`` a ``Planner``.

For a deployment whose workers outlive any one process (Kubernetes), the same
cluster runs as two kinds of process that share a Redis, a namespace and a
cluster secret:

- ``pdserve controller --address RAY --namespace NS`` owns the pools: it takes
  the deployment's lease (a second controller waits for it), adopts the live
  detached workers an earlier controller started, starts the missing ones as
  detached named actors, and runs the supervisor and planner. On SIGTERM it
  leaves the workers serving; it exits 1 if another controller took the lease, or if Redis did not answer for
  the lease's TTL (it cannot tell then; its Deployment restarts it), saying which.
- ``pdserve router --namespace NS`` is a stateless front end: it only reads the
  registry (no Ray), so any number run side by side and each can be restarted,
  scaled or rolled without touching a worker. On SIGTERM it drains and exits.

``pdserve down --address RAY --namespace NS`` tears such a deployment down.

The flags are in ``cluster.up_flags``, their checks in ``cluster.up_checks``, the secrets in
``cluster.up_secrets`` and the signal loop in ``cluster.serve_loop``; this module holds the three
commands.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import Callable, Optional

from cluster.serve_loop import run_until_signal, wait_listening, wait_serving
from cluster.up_checks import check_model_args, check_pool_args, check_router_args, check_up_args, encoder_pools
from cluster.up_flags import pool_config_kwargs, router_overrides, sla_config
from cluster.up_secrets import read_cluster_tls, read_split_secrets, read_up_secrets, secret_source

__all__ = ["cmd_up", "cmd_controller", "cmd_router", "run_until_signal", "wait_serving"]


def _wait_router(address: str, args: argparse.Namespace) -> None:
    if args.ssl_certfile is None:
        wait_serving(address, args.ready_timeout)
    else:
        # The router reported SERVING in-process when it started. A gRPC probe over its TLS port would need
        # to verify the router's certificate (issued by a CA this process may not hold) and, with mutual
        # TLS, a client certificate: check that the port answers instead.
        wait_listening(address, args.ready_timeout)


def _start_loops(cluster, args: argparse.Namespace) -> tuple:
    """The supervisor (always) and, with --autoscale, the planner of ``cluster``."""
    from cluster.planner import Planner, PlannerConfig
    from cluster.supervisor import Supervisor, SupervisorConfig

    # The floors are the start sizes, which are also the planner's minimums.
    supervisor = Supervisor(cluster, SupervisorConfig(check_interval_s=args.check_interval)).start()
    planner = None
    if args.autoscale:
        planner = Planner(cluster, PlannerConfig(
            min_prefill=args.prefill, max_prefill=max(args.max_prefill, args.prefill, 1),
            min_decode=args.decode, max_decode=max(args.max_decode, args.decode, 1),
            min_colocated=args.colocated, max_colocated=max(args.colocated, args.max_decode, 1),
            interval_s=args.planner_interval, cooldown_s=args.planner_cooldown, policy=args.planner,
            sla=sla_config(args) if args.planner == "sla" else None),
            supervisor=supervisor).start()
    return supervisor, planner


def _stop_loops(loops: list) -> None:
    for loop in loops:
        if loop is not None:
            loop.stop(wait=False)  # cluster.stop() interrupts a scale it may be in


def cmd_up(args: argparse.Namespace) -> int:
    """``pdserve up``: run until a signal, then stop everything that was started."""
    # Ray's driver otherwise installs a C++ "failure" handler for SIGTERM that aborts the process
    # before our handler can stop the cluster cleanly. Ray reads it at import, hence before the import.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    from cluster.launcher import Cluster, ClusterConfig

    check_up_args(args)
    encoder_pools(args)
    api_keys, cluster_secret, redis_url = read_up_secrets(args)
    prepare_cpu_kernels(args)
    cfg = ClusterConfig(**pool_config_kwargs(args), router_port=args.port, redis_url=redis_url,
                        router_overrides=router_overrides(args), api_keys=api_keys,
                        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
                        cluster_secret=cluster_secret, cluster_tls=read_cluster_tls(args))
    cluster = Cluster(cfg)

    def ready(planner) -> None:
        _wait_router(cluster.router_address, args)
        _print_endpoints(cluster, planner, args, secret_source(args, cluster_secret))

    return _run_cluster(cluster, args, ready)


def prepare_cpu_kernels(args: argparse.Namespace) -> None:
    """Build (or find) this machine's CPU kernels before any worker starts, in a child process whose output reaches
    this terminal: the first start on a machine compiles them for minutes, and from inside Ray's worker actors
    (whose logs do not reach the driver) that looked like a hang. A build an earlier load noted
    (``engine.kernels.built_without_torch``: found without importing torch) needs no child: that saves the child's
    torch import, 1.6 s of a start here (1 Dec). A start that must wait for another process's
    build says so here (``engine.kernels``). Only for a private local Ray on CPU: elsewhere each node builds its
    own. Ctrl-C reaches the child too; an interrupted build never blocks the next start."""
    if getattr(args, "address", None) is not None or os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
        return
    device = getattr(args, "device", "auto")
    if device == "cuda" or (device == "auto" and shutil.which("nvidia-smi") is not None):
        return
    # on stderr, with the child's output: stdout carries the SERVING banner that scripts read first
    print("pdserve: preparing the CPU kernels (the first start on a machine compiles them; minutes)",
          file=sys.stderr, flush=True)
    from engine.kernels import built_without_torch, report

    if built_without_torch() is not None:  # a finished build a load noted: no child (its torch import) needed
        print(report(True), file=sys.stderr, flush=True)
        return
    rc = subprocess.run([sys.executable, "-m", "engine.kernels"], stdout=sys.stderr, check=False).returncode
    if rc != 0:  # the workers try again and fall back to plain torch ops, as before
        print(f"pdserve: the CPU kernel build exited with {rc}; the workers fall back to plain torch ops if they "
              "cannot build them either", file=sys.stderr, flush=True)


def _run_cluster(cluster, args: argparse.Namespace, ready: Callable[[object], None],
                 failed: Callable[[], Optional[str]] = lambda: None) -> int:
    """Start ``cluster`` with its supervisor (and planner), ``ready(planner)``, run until a signal, stop."""
    loops: list = []

    def start() -> None:
        cluster.start()
        loops.extend(_start_loops(cluster, args))

    def stop() -> None:
        _stop_loops(loops)
        cluster.stop()  # a detached controller's stop leaves the workers serving

    return run_until_signal(start, lambda: ready(loops[1]), stop, failed)


def cmd_controller(args: argparse.Namespace) -> int:
    """``pdserve controller``: keep a deployment's pools until a signal; the workers outlive it."""
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    from cluster.launcher import Cluster, ClusterConfig

    check_pool_args(args)
    check_model_args(args)
    _, cluster_secret, redis_url = read_split_secrets(args)
    cfg = ClusterConfig(**pool_config_kwargs(args), redis_url=redis_url, cluster_secret=cluster_secret,
                        cluster_tls=read_cluster_tls(args), detached=True, router_factory=False,
                        start_timeout_s=args.ready_timeout)
    cluster = Cluster(cfg)

    def ready(planner) -> None:
        pools = " ".join(f"{r}={','.join(cluster.worker_ids(r))}" for r in ("prefill", "decode", "colocated")
                         if cluster.worker_ids(r))
        lines = [f"pdserve CONTROLLING deployment={cluster.namespace} generation={cluster.generation}",
                 f"  workers  {pools} (device {cluster.config.device}; detached: they outlive this process)",
                 f"  adopted  {', '.join(cluster.adopted) or 'none'}",
                 f"  redis    {cluster.display_redis_url}"]
        if planner is not None:
            lines.append(_planner_line(planner))
        print("\n".join(lines), flush=True)

    def failed() -> Optional[str]:
        return (cluster.lease_lost_reason or "the deployment's lease was lost") if cluster.lease_lost else None

    return _run_cluster(cluster, args, ready, failed)


def cmd_router(args: argparse.Namespace) -> int:
    """``pdserve router``: serve the public API for a deployment's workers until a signal."""
    from cluster.config import ClusterConfig, build_router
    from cluster.registry import Registry

    check_model_args(args)
    check_router_args(args)
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    api_keys, cluster_secret, redis_url = read_split_secrets(args)
    colocated = args.mode == "colocated"
    # A router reads pools; the config's pool sizes only pick its mode.
    cfg = ClusterConfig(model=args.model, served_model_name=args.served_model_name, num_prefill=0, num_decode=0,
                        num_colocated=int(colocated), host=args.host, router_port=args.port, redis_url=redis_url,
                        namespace=args.namespace, router_overrides=router_overrides(args), api_keys=api_keys,
                        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
                        cluster_secret=cluster_secret, cluster_tls=read_cluster_tls(args))
    registry = Registry(redis_url, args.namespace)
    router = build_router(cfg, registry)
    from cluster.redis_server import mask_url

    def ready() -> None:
        _wait_router(router.address, args)
        http = getattr(router, "http_address", "")
        lines = [f"pdserve SERVING router={router.address}", f"  deployment {args.namespace} ({args.mode}) on "
                 f"{mask_url(redis_url)}; workers are the controller's: this router only reads the registry"]
        if http:
            lines.append(f"  http     http://{http}/v1  (OpenAI-compatible: completions, chat, models; /health)")
        if router.health_address:
            lines.append(f"  health   {router.health_address}  (plaintext grpc.health.v1 only, for probes)")
        metrics = getattr(router, "metrics_address", "")
        if metrics:
            lines.append(f"  metrics  http://{metrics}/metrics")
        print("\n".join(lines), flush=True)

    def stop() -> None:
        try:
            # NOT_SERVING, refuse new requests, let in-flight ones finish; never touches a worker or a registry key
            if not router.drain(args.drain_timeout):
                print(f"pdserve: router drain left requests unfinished after {args.drain_timeout:g} s",
                      file=sys.stderr, flush=True)
        finally:
            registry.close()

    return run_until_signal(router.start, ready, stop)


def _print_endpoints(cluster, planner, args: argparse.Namespace, secret_source: str) -> None:
    # No secret is printed: keys are counted, the Redis URL is masked.
    tls = ("mutual TLS" if args.ssl_ca_certs else "TLS") if args.ssl_certfile else "plaintext"
    keys = cluster.config.api_keys
    lines = [f"pdserve SERVING router={cluster.router_address}",
             f"  router   {cluster.router_address}  (gRPC pdserve.v1.PDServe, health, reflection; {tls}, "
             + (f"{len(keys)} API key(s) required)" if keys else "no API key: open to whoever reaches it)")]
    http = getattr(cluster.router, "http_address", "")
    if http:
        lines.append(f"  http     http://{http}/v1  (OpenAI-compatible: completions, chat, models; /health)")
    health = getattr(cluster.router, "health_address", "")
    if health:
        lines.append(f"  health   {health}  (plaintext grpc.health.v1 only, for probes)")
    for name, addr in sorted(cluster.metrics_addresses().items()):
        lines.append(f"  metrics  {name:<12} http://{addr}/metrics")
    lines.append(f"  model    {cluster.config.served_model_name}  (served name: requests, /v1/models, metric labels)")
    lines.append(f"  redis    {cluster.display_redis_url}  namespace {cluster.namespace}")
    tls = cluster.config.cluster_tls is not None
    lines.append(f"  cluster  workers accept only the cluster secret ({secret_source})"
                 + (", over mutual TLS (cluster CA)" if tls else ""))
    pools = " ".join(f"{r}={len(cluster.worker_ids(r))}" for r in ("prefill", "decode", "colocated")
                     if cluster.worker_ids(r))
    lines.append(f"  workers  {pools} ({cluster.config.mode}, device {cluster.config.device})")
    if planner is not None:
        lines.append(_planner_line(planner))
    print("\n".join(lines), flush=True)


def _planner_line(planner) -> str:
    bounds = ", ".join(f"{r} {'..'.join(map(str, planner.config.bounds(r)))}" for r in planner.roles())
    how = planner.config.policy
    sla = planner.config.sla
    if sla is not None and how == "sla":
        how += f": TTFT {sla.ttft_slo_ms:g} ms, TPOT {sla.tpot_slo_ms:g} ms"
    return f"  planner  {bounds} ({how}; every {planner.config.interval_s:g} s)"
