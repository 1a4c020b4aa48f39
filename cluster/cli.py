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

from loadtest.auth import API_KEY_ENV, ClientAuth, add_client_auth_args, client_auth_from_args

BUILTIN_MODELS = ("tiny", "bench")
CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
"""Environment variable with the cluster secret (else --cluster-secret-file, else a generated one)."""
REDIS_URL_ENV = "PDSERVE_REDIS_URL"
"""Environment variable with the Redis URL (keeps its password off argv)."""
SECRET_ENVS = (API_KEY_ENV, CLUSTER_SECRET_ENV, REDIS_URL_ENV)


class _Shutdown(BaseException):
    """Raised in the main thread by SIGINT/SIGTERM (a BaseException so no `except Exception` swallows it)."""


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run a cluster until SIGINT/SIGTERM",
                       description="Start Redis (unless --redis-url), Ray (unless --address), prefill and decode "
                                   "worker actors and the router; stop all of it on SIGINT/SIGTERM.")
    p.add_argument("--model", default="tiny", help="tiny | bench | path to a Hugging Face model dir (default tiny)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name to clients (/v1/models, ModelInfo, the requests' model field) and in "
                        "metric labels (default: the built-in name or the model directory's basename)")
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers (default 1)")
    p.add_argument("--colocated", type=int, default=0, metavar="K",
                   help="run K colocated workers instead of prefill/decode pools (the baseline)")
    p.add_argument("--autoscale", action="store_true",
                   help="run the planner: each pool scales between its start size and --max-prefill/--max-decode")
    p.add_argument("--max-prefill", type=int, default=4, help="most prefill workers with --autoscale (default 4)")
    p.add_argument("--max-decode", type=int, default=4, help="most decode workers with --autoscale (default 4)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address every listener binds: router gRPC and metrics, the embedded Redis and, on a "
                        "local Ray, the workers' gRPC, metrics and gloo (default 127.0.0.1; multi-node: this "
                        "node's own address; a wildcard such as 0.0.0.0 only when given here)")
    p.add_argument("--port", type=int, default=50051, help="router port, 0 = free port (default 50051)")
    p.add_argument("--http-port", type=int, default=8000, metavar="PORT",
                   help="OpenAI-compatible HTTP API port on --host (default 8000; 0 turns it off)")
    p.add_argument("--redis-url", default=None,
                   help=f"external Redis, redis://:PASSWORD@host:port/db or rediss:// for TLS (default: "
                        f"${REDIS_URL_ENV}, else a private embedded one with a generated password); a password "
                        f"on argv is visible in ps: prefer ${REDIS_URL_ENV}")
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
    sec = p.add_argument_group("security", "Secrets are read from files or the environment, never printed; see "
                                           "docs/security.md.")
    sec.add_argument("--ssl-certfile", default=None, metavar="FILE",
                     help="PEM certificate chain: serve the public gRPC API over TLS (with --ssl-keyfile)")
    sec.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="PEM private key of --ssl-certfile")
    sec.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                     help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    sec.add_argument("--api-key", action="append", default=[], metavar="KEY",
                     help=f"require 'authorization: Bearer KEY' on the public API (repeatable). Visible in ps: "
                          f"prefer ${API_KEY_ENV} (comma-separated keys)")
    sec.add_argument("--cluster-secret-file", default=None, metavar="FILE",
                     help=f"file holding the secret the router presents to the workers (or ${CLUSTER_SECRET_ENV}; "
                          f"default: a fresh one per run). Give the same one to every launcher of one cluster")


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
    add_client_auth_args(p)


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
    p.add_argument("--redis-url", default=None,
                   help=f"the Redis it used, e.g. redis://:PASSWORD@host:6379/0 (default ${REDIS_URL_ENV}; a "
                        f"password on argv is visible in ps)")
    p.add_argument("--wait", type=float, default=15.0, metavar="S",
                   help="seconds to wait for the dead run's worker records to expire (default 15)")


def cmd_down(args: argparse.Namespace) -> int:
    """``pdserve down``: delete a dead run's keys from Redis and list them on stdout."""
    from cluster.registry import Registry

    if not args.wait >= 0:
        raise ValueError(f"--wait must be >= 0, got {args.wait}")
    redis_url = _redis_url(args)
    if redis_url is None:
        raise ValueError(f"--redis-url (or ${REDIS_URL_ENV}) is required")
    with Registry(redis_url, args.namespace) as reg:
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
    if args.served_model_name is not None and (not args.served_model_name.strip()
                                               or not args.served_model_name.isprintable()):
        raise ValueError(f"--served-model-name must be a non-empty printable name, got {args.served_model_name!r}")
    if args.autoscale:
        for name, lo, hi in (("prefill", args.prefill, args.max_prefill), ("decode", args.decode, args.max_decode)):
            if not args.colocated and hi < max(lo, 1):
                raise ValueError(f"--max-{name} must be >= max(--{name}, 1), got {hi}")
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise ValueError("--ssl-certfile and --ssl-keyfile must be given together")
    if args.ssl_ca_certs is not None and args.ssl_certfile is None:
        raise ValueError("--ssl-ca-certs (mutual TLS) needs --ssl-certfile and --ssl-keyfile")
    for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path is not None and not os.access(path, os.R_OK):
            raise ValueError(f"{flag}: cannot read {path!r}")
    if args.port:
        _check_port_free(args.host, args.port)
    if not 0 <= args.http_port < 65536:
        raise ValueError(f"--http-port must be in [0, 65535] (0 turns the HTTP API off), got {args.http_port}")
    if args.http_port:
        _check_port_free(args.host, args.http_port, "--http-port")
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
    out["http_port"] = args.http_port or None  # 0: no HTTP API
    return out


def _as_flag_error(e: ValueError, fields: dict) -> ValueError:
    """A config's "field must be ..." error, named by the command-line flag that set the field."""
    msg = str(e)
    for name in fields:
        if msg.startswith(name + " "):
            return ValueError("--" + name.replace("_", "-") + msg[len(name):])
    return e


def _check_port_free(host: str, port: int, flag: str = "--port") -> None:
    # Fail in a second, not after Ray and the workers have started (the router binds last).
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"{flag} {port} on {host} is not available: {e.strerror}") from None


def wait_serving(address: str, timeout_s: float, auth: Optional[ClientAuth] = None) -> None:
    """Block until ``address`` answers grpc.health SERVING; TimeoutError otherwise.

    ``auth``: TLS trust (and client certificate) for a router serving TLS; health needs no API key."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with (auth or ClientAuth()).channel(address) as ch:
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


def _redis_url(args: argparse.Namespace) -> Optional[str]:
    """--redis-url, else $PDSERVE_REDIS_URL; warns when a password was given on argv (ps shows it)."""
    from cluster.redis_server import mask_url

    if args.redis_url:
        if mask_url(args.redis_url) != args.redis_url:
            print(f"pdserve: warning: the --redis-url password is visible to every user of this machine (ps); "
                  f"set ${REDIS_URL_ENV} instead", file=sys.stderr)
        return args.redis_url
    return os.environ.get(REDIS_URL_ENV) or None


def _read_secret_file(path: str) -> str:
    try:
        st = os.stat(path)
        with open(path, "r") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"--cluster-secret-file: cannot read {path!r}: {e.strerror}") from None
    if st.st_mode & 0o077:
        print(f"pdserve: warning: --cluster-secret-file {path} is readable by other users (chmod 600 it)",
              file=sys.stderr)
    return secret


def _up_secrets(args: argparse.Namespace) -> tuple[tuple[str, ...], Optional[str], Optional[str]]:
    """(API keys, cluster secret or None to generate one, Redis URL or None) from flags, files and the
    environment. The variables are then removed from this process's environment, so the Ray processes it
    starts (and their actors) do not inherit them: the secrets reach the actors inside their configs."""
    keys = list(args.api_key)
    if keys:
        print(f"pdserve: warning: --api-key is visible to every user of this machine (ps); "
              f"set ${API_KEY_ENV} (comma-separated) instead", file=sys.stderr)
    keys += [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    if any(not k or any(c.isspace() for c in k) for k in keys):
        raise ValueError("--api-key: keys must be non-empty without whitespace (values not shown)")
    if args.cluster_secret_file:
        secret = _read_secret_file(args.cluster_secret_file)
    else:
        secret = os.environ.get(CLUSTER_SECRET_ENV) or None
    if secret is not None and len(secret) < 16:
        raise ValueError(f"--cluster-secret-file/${CLUSTER_SECRET_ENV}: the cluster secret must be at least "
                         f"16 characters (value not shown); make one with python -c 'import secrets; "
                         f"print(secrets.token_urlsafe(32))'")
    redis_url = _redis_url(args)
    for name in SECRET_ENVS:
        os.environ.pop(name, None)
    return tuple(dict.fromkeys(keys)), secret, redis_url


def _wait_listening(address: str, timeout_s: float) -> None:
    """Block until a TCP connection to ``address`` succeeds; TimeoutError otherwise."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"router {address} not listening within {timeout_s}s") from None
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
    api_keys, cluster_secret, redis_url = _up_secrets(args)
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
    cfg = ClusterConfig(model=args.model, served_model_name=args.served_model_name,
                        num_prefill=args.prefill, num_decode=args.decode,
                        num_colocated=args.colocated,
                        host=args.host, router_port=args.port, redis_url=redis_url,
                        ray_address=args.address, namespace=args.namespace,
                        cpus_per_worker=args.cpus_per_worker, engine_overrides=engine_overrides,
                        router_overrides=router_overrides, api_keys=api_keys, ssl_certfile=args.ssl_certfile,
                        ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
                        cluster_secret=cluster_secret)
    stop = threading.Event()
    stopping = False

    def on_signal(signum: int, _frame) -> None:
        if stopping:
            return  # already tearing down: let it finish
        stop.set()
        raise _Shutdown(signal.Signals(signum).name)

    cluster_secret_source = ("file" if args.cluster_secret_file else
                             "environment" if cluster_secret else "generated for this run")
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
        if args.ssl_certfile is None:
            wait_serving(cluster.router_address, args.ready_timeout)
        else:
            # The router reported SERVING in-process when it started. A gRPC probe over its TLS port would need
            # to verify the router's certificate (issued by a CA this process may not hold) and, with mutual
            # TLS, a client certificate: check that the port answers instead.
            _wait_listening(cluster.router_address, args.ready_timeout)
        _print_endpoints(cluster, planner, args, cluster_secret_source)
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
    for name, addr in sorted(cluster.metrics_addresses().items()):
        lines.append(f"  metrics  {name:<12} http://{addr}/metrics")
    lines.append(f"  model    {cluster.config.served_model_name}  (served name: requests, /v1/models, metric labels)")
    lines.append(f"  redis    {cluster.display_redis_url}  namespace {cluster.namespace}")
    lines.append(f"  cluster  workers accept only the cluster secret ({secret_source})")
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
    auth = client_auth_from_args(args)
    last = None
    with auth.channel(args.target) as ch:
        call = pdserve_pb2_grpc.PDServeStub(ch).Generate(req, timeout=args.timeout, metadata=auth.metadata())
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
