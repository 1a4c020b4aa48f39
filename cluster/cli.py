"""The ``pdserve`` command: ``up`` runs a cluster, ``generate`` streams a completion, ``bench`` load-tests.

Lifecycle of ``pdserve up``: parse flags -> ``Cluster.start()`` (Redis, Ray,
pools, router) -> wait until the router's grpc.health says SERVING -> print
the router address and metrics endpoints -> block until SIGINT/SIGTERM ->
``Cluster.stop()`` stops every process it started (actors, Ray and Redis if
it started them, router) and deletes its Redis keys -> exit 0. A signal that
arrives while the cluster is still starting aborts the start the same way.

``pdserve up`` also runs a ``Supervisor`` (always) that replaces dead or stuck
workers under new ids, and with ``--autoscale`` a ``Planner``. With
``--namespace NS`` it first deletes what a killed run left in that namespace.

``pdserve down --namespace NS --redis-url URL`` is that clean-up alone, for
after a ``pdserve up`` was SIGKILLed (see its ``--help`` for what Ray leaves).

``pdserve generate PROMPT`` is a thin client of the public API (streams text
deltas to stdout); ``pdserve bench ...`` hands its arguments to
``loadtest.cli.main``.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Optional, Sequence

BUILTIN_MODELS = ("tiny", "bench")


class _Shutdown(BaseException):
    """Raised in the main thread by SIGINT/SIGTERM (a BaseException so no `except Exception` swallows it)."""


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run a cluster until SIGINT/SIGTERM",
                       description="Start Redis (unless --redis-url), Ray (unless --address), prefill and decode "
                                   "worker actors and the router; stop all of it on SIGINT/SIGTERM.")
    p.add_argument("--model", default="tiny", help="tiny | bench | path to a Hugging Face model dir (default tiny)")
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers (default 1)")
    p.add_argument("--colocated", type=int, default=0, metavar="K",
                   help="run K colocated workers instead of prefill/decode pools (the baseline)")
    p.add_argument("--autoscale", action="store_true",
                   help="run the planner: each pool scales between its start size and --max-prefill/--max-decode")
    p.add_argument("--max-prefill", type=int, default=4, help="most prefill workers with --autoscale (default 4)")
    p.add_argument("--max-decode", type=int, default=4, help="most decode workers with --autoscale (default 4)")
    p.add_argument("--host", default="127.0.0.1", help="router bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="router port, 0 = free port (default 50051)")
    p.add_argument("--redis-url", default=None, help="external Redis (default: a private embedded one)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join, e.g. auto (default: start a private local Ray)")
    p.add_argument("--namespace", default=None, help="registry namespace (default: a unique one)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="Ray CPUs (and torch threads) per worker")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per worker (default: by memory)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="running sequences per decode worker")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="turn off the engines' automatic prefix caching (on by default)")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0, metavar="N",
                   help="conditional disaggregation: prompts of at most N tokens are prefilled on the decode "
                        "worker itself (default 0: always use the prefill pool)")
    p.add_argument("--prefill-queue-max-tokens", type=int, default=None, metavar="N",
                   help="conditional disaggregation: prefill on the decode worker when every prefill worker has "
                        ">= N prompt tokens queued (default: never)")
    p.add_argument("--max-num-requests", type=int, default=None, metavar="N",
                   help="requests the router holds at once (running + queued); past it a request gets "
                        "RESOURCE_EXHAUSTED at once (router default 192; must stay below its 256 RPC threads)")
    p.add_argument("--check-interval", type=float, default=1.0, metavar="S",
                   help="seconds between the supervisor's health checks of the workers; a dead or stuck "
                        "worker is replaced under a new id (default 1)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for SERVING")
    p.add_argument("--log-level", default="WARNING", help="Python log level (default WARNING)")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running cluster")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--target", default="127.0.0.1:50051", help="router host:port (default 127.0.0.1:50051)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens (server default 16)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (server default 1.0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    p.add_argument("--timeout", type=float, default=120.0, help="request deadline in seconds (default 120)")
    p.add_argument("--usage", action="store_true", help="print finish reason, usage and timings to stderr")


_DOWN_EPILOG = """\
What a SIGKILLed `pdserve up` leaves (measured with Ray 2.60, private local Ray, one machine):
  - Redis: its kvtransfer rendezvous keys ({ns}:kvt/...), which expire 10 min after their last write
    (they never did before that TTL was added: measured then); the worker records
    ({ns}:worker:*, {ns}:workers) expire by themselves within the TTL (3 s) once the actors are gone
    (all gone 5 s after the kill). `pdserve down` removes the rest; `pdserve up --namespace NS`
    does the same before it starts.
  - Ray: gcs_server, raylet and Ray's Python helper processes die with the driver at once; the
    worker actors and idle Ray workers within 5 s (they fate-share with their owner, the driver);
    the orphaned ray::DashboardAgent and ray::RuntimeEnvAgent processes linger (still alive 60 s
    after the kill, gone at 120 s), and the private temp dir /tmp/pdray* (logs, sockets) stays
    until removed by hand. `pdserve down` does not touch processes or files.
  (Not measured: a joined Ray cluster, --address; there the Ray processes are not pdserve's.)
"""


def _add_down(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("down", help="remove what a killed `pdserve up` left in Redis",
                       description="Delete every Redis key of one namespace (worker records, index, kvtransfer "
                                   "rendezvous keys) left by a `pdserve up` that was killed (SIGKILL, a lost "
                                   "node) and print them. Refuses while workers of that namespace still "
                                   "heartbeat (a running cluster).",
                       epilog=_DOWN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--namespace", required=True, help="the namespace the dead `pdserve up` used")
    p.add_argument("--redis-url", required=True, help="the Redis it used, e.g. redis://host:6379/0")
    p.add_argument("--wait", type=float, default=15.0, metavar="S",
                   help="seconds to wait for the dead run's worker records to expire (default 15)")


def cmd_down(args: argparse.Namespace) -> int:
    """``pdserve down``: delete a dead run's keys from Redis and list them on stdout."""
    from cluster.registry import Registry

    if not args.wait >= 0:
        raise ValueError(f"--wait must be >= 0, got {args.wait}")
    with Registry(args.redis_url, args.namespace) as reg:
        reg.ping()
        keys = reg.clear_stale(wait_s=args.wait)
    for key in keys:
        print(f"removed {key}")
    print(f"pdserve down: removed {len(keys)} key(s) of namespace {args.namespace}", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve`` argument parser (``bench`` is parsed by loadtest)."""
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{up,down,generate,bench}")
    _add_up(sub)
    _add_down(sub)
    _add_generate(sub)
    sub.add_parser("bench", help="load-test a running cluster (see `pdserve bench --help`)", add_help=False)
    return parser


def _check_up_args(args: argparse.Namespace) -> None:
    if args.prefill < 0:
        raise ValueError(f"--prefill must be >= 0, got {args.prefill}")
    if args.decode < 0:
        raise ValueError(f"--decode must be >= 0, got {args.decode}")
    if args.colocated < 0:
        raise ValueError(f"--colocated must be >= 0, got {args.colocated}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.model not in BUILTIN_MODELS and not os.path.isdir(args.model):
        raise ValueError(f"--model must be one of {BUILTIN_MODELS} or a model directory, got {args.model!r}")
    if args.autoscale:
        for name, lo, hi in (("prefill", args.prefill, args.max_prefill), ("decode", args.decode, args.max_decode)):
            if not args.colocated and hi < max(lo, 1):
                raise ValueError(f"--max-{name} must be >= max(--{name}, 1), got {hi}")
    if args.port:
        _check_port_free(args.host, args.port)
    # the fields the configs own are checked by the configs themselves, reported under the flag's name
    from engine.config import EngineConfig
    from router.config import RouterConfig

    engine_kw = {k: v for k, v in (("num_kv_blocks", args.num_kv_blocks), ("max_num_seqs", args.max_num_seqs))
                 if v is not None}
    if not args.check_interval > 0:
        raise ValueError(f"--check-interval must be > 0, got {args.check_interval}")
    for build, kw in ((RouterConfig, _router_overrides(args)), (EngineConfig, engine_kw)):
        try:
            build(**kw)
        except ValueError as e:
            raise _as_flag_error(e, kw) from None


def _router_overrides(args: argparse.Namespace) -> dict:
    """The RouterConfig fields ``pdserve up``'s flags set."""
    out = {"local_prefill_max_tokens": args.local_prefill_max_tokens,
           "prefill_queue_max_tokens": args.prefill_queue_max_tokens}
    if args.max_num_requests is not None:
        out["max_num_requests"] = args.max_num_requests
    return out


def _as_flag_error(e: ValueError, fields: dict) -> ValueError:
    """A config's "field must be ..." error, named by the command-line flag that set the field."""
    msg = str(e)
    for name in fields:
        if msg.startswith(name + " "):
            return ValueError("--" + name.replace("_", "-") + msg[len(name):])
    return e


def _check_port_free(host: str, port: int) -> None:
    # Fail in a second, not after Ray and the workers have started (the router binds last).
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"--port {port} on {host} is not available: {e.strerror}") from None


def wait_serving(address: str, timeout_s: float) -> None:
    """Block until ``address`` answers grpc.health SERVING; TimeoutError otherwise."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"router {address} not SERVING within {timeout_s}s")
            time.sleep(0.2)


def cmd_up(args: argparse.Namespace) -> int:
    """``pdserve up``: run until a signal, then stop everything that was started."""
    # Ray's driver otherwise installs a C++ "failure" handler for SIGTERM that aborts the process
    # before our handler can stop the cluster cleanly. Ray reads it at import, hence before the import.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    from cluster.launcher import Cluster, ClusterConfig
    from cluster.planner import Planner, PlannerConfig
    from cluster.supervisor import Supervisor, SupervisorConfig

    _check_up_args(args)
    engine_overrides = {}
    if args.num_kv_blocks is not None:
        engine_overrides["num_kv_blocks"] = args.num_kv_blocks
    if args.max_num_seqs is not None:
        engine_overrides["max_num_seqs"] = args.max_num_seqs
    if args.no_prefix_caching:
        engine_overrides["enable_prefix_caching"] = False
    router_overrides = _router_overrides(args)
    if args.colocated:  # one mode per router: colocated replaces the two pools
        args.prefill = args.decode = 0
    cfg = ClusterConfig(model=args.model, num_prefill=args.prefill, num_decode=args.decode,
                        num_colocated=args.colocated,
                        router_host=args.host, router_port=args.port, redis_url=args.redis_url,
                        ray_address=args.address, namespace=args.namespace,
                        cpus_per_worker=args.cpus_per_worker, engine_overrides=engine_overrides,
                        router_overrides=router_overrides)
    stop = threading.Event()
    stopping = False

    def on_signal(signum: int, _frame) -> None:
        if stopping:
            return  # already tearing down: let it finish
        stop.set()
        raise _Shutdown(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    cluster = Cluster(cfg)
    planner = supervisor = None
    try:
        cluster.start()
        # Always on: a dead or stuck worker is replaced (new id) so every pool keeps its size; the floors
        # are the start sizes, which are also the planner's minimums.
        supervisor = Supervisor(cluster, SupervisorConfig(check_interval_s=args.check_interval)).start()
        if args.autoscale:
            planner = Planner(cluster, PlannerConfig(
                min_prefill=args.prefill, max_prefill=max(args.max_prefill, args.prefill, 1),
                min_decode=args.decode, max_decode=max(args.max_decode, args.decode, 1),
                min_colocated=args.colocated, max_colocated=max(args.colocated, args.max_decode, 1)),
                supervisor=supervisor).start()
        # ray.init installs its own SIGTERM handler (sys.exit(15)); take SIGTERM back for a clean stop.
        for s in previous:
            signal.signal(s, on_signal)
        wait_serving(cluster.router_address, args.ready_timeout)
        _print_endpoints(cluster, planner)
        while not stop.wait(1.0):
            pass
    except _Shutdown as e:
        print(f"pdserve: {e}, stopping", file=sys.stderr, flush=True)
    except SystemExit as e:
        if e.code != signal.SIGTERM:  # Ray's handler fired while the cluster was still starting
            raise
        print("pdserve: SIGTERM, stopping", file=sys.stderr, flush=True)
    finally:
        stopping = True
        try:
            for loop in (planner, supervisor):
                if loop is not None:
                    loop.stop(wait=False)  # cluster.stop() interrupts a scale it may be in
            cluster.stop()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    print("pdserve: stopped", file=sys.stderr, flush=True)
    return 0


def _print_endpoints(cluster, planner) -> None:
    lines = [f"pdserve SERVING router={cluster.router_address}",
             f"  router   {cluster.router_address}  (gRPC pdserve.v1.PDServe, health, reflection)"]
    for name, addr in sorted(cluster.metrics_addresses().items()):
        lines.append(f"  metrics  {name:<12} http://{addr}/metrics")
    lines.append(f"  redis    {cluster.redis_url}  namespace {cluster.namespace}")
    pools = " ".join(f"{r}={len(cluster.worker_ids(r))}" for r in ("prefill", "decode", "colocated")
                     if cluster.worker_ids(r))
    lines.append(f"  workers  {pools} ({cluster.config.mode})")
    if planner is not None:
        bounds = ", ".join(f"{r} {'..'.join(map(str, planner.config.bounds(r)))}" for r in planner.roles())
        lines.append(f"  planner  {bounds} (every {planner.config.interval_s:g} s)")
    print("\n".join(lines), flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    """``pdserve generate``: stream one completion's text to stdout."""
    import grpc

    from proto import pdserve_pb2, pdserve_pb2_grpc

    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    req = pdserve_pb2.GenerateRequest(prompt=args.prompt, stop=args.stop, ignore_eos=args.ignore_eos)
    for field, value in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                         ("top_p", args.top_p), ("top_k", args.top_k), ("min_p", args.min_p),
                         ("seed", args.seed)):
        if value is not None:
            setattr(req, field, value)
    last = None
    with grpc.insecure_channel(args.target) as ch:
        call = pdserve_pb2_grpc.PDServeStub(ch).Generate(req, timeout=args.timeout)
        try:
            for resp in call:
                if resp.text:
                    sys.stdout.write(resp.text)
                    sys.stdout.flush()
                last = resp
        except grpc.RpcError as e:
            sys.stdout.write("\n")
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            call.cancel()
            sys.stdout.write("\n")
            return 130
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.usage and last is not None:
        u, t = last.usage, last.timings
        print(f"[{last.request_id}] finish={last.finish_reason} prompt_tokens={u.prompt_tokens} "
              f"completion_tokens={u.completion_tokens} ttft={t.ttft_s:.3f}s total={t.total_s:.3f}s",
              file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``pdserve`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from loadtest.cli import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help or a usage error
        return int(e.code or 0)
    level = getattr(args, "log_level", "WARNING")
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.WARNING), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "up":
            return cmd_up(args)
        if args.command == "down":
            return cmd_down(args)
        return cmd_generate(args)
    except ValueError as e:
        print(f"pdserve {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a failed start (worker could not load, no resources...): say why, exit non-zero
        logging.getLogger(__name__).debug("pdserve %s failed", args.command, exc_info=True)
        print(f"pdserve {args.command}: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
