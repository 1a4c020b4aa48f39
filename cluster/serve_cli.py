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
  leaves the workers serving; it exits 1 if another controller took the lease.
- ``pdserve router --namespace NS`` is a stateless front end: it only reads the
  registry (no Ray), so any number run side by side and each can be restarted,
  scaled or rolled without touching a worker. On SIGTERM it drains and exits.

``pdserve down --address RAY --namespace NS`` tears such a deployment down.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

from transport.client_auth import API_KEY_ENV, ClientAuth

BUILTIN_MODELS = ("tiny", "bench")
CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
"""Environment variable with the cluster secret (else --cluster-secret-file, else a generated one)."""
REDIS_URL_ENV = "PDSERVE_REDIS_URL"
"""Environment variable with the Redis URL (keeps its password off argv)."""
SECRET_ENVS = (API_KEY_ENV, CLUSTER_SECRET_ENV, REDIS_URL_ENV)


class _Shutdown(BaseException):
    """Raised in the main thread by SIGINT/SIGTERM (a BaseException so no `except Exception` swallows it)."""


# ---- flags ------------------------------------------------------------------------------------------
def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --served-model-name."""
    p.add_argument("--model", default="tiny", help="tiny | bench | path to a Hugging Face model dir (default tiny)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name to clients (/v1/models, ModelInfo, the requests' model field) and in "
                        "metric labels (default: the built-in name or the model directory's basename)")


def add_pool_args(p: argparse.ArgumentParser) -> None:
    """The worker pools: sizes, planner bounds, engine knobs, supervisor, device."""
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers (default 1)")
    p.add_argument("--colocated", type=int, default=0, metavar="K",
                   help="run K colocated workers instead of prefill/decode pools (the baseline)")
    p.add_argument("--autoscale", action="store_true",
                   help="run the planner: each pool scales between its start size and --max-prefill/--max-decode")
    p.add_argument("--max-prefill", type=int, default=4, help="most prefill workers with --autoscale (default 4)")
    p.add_argument("--max-decode", type=int, default=4, help="most decode workers with --autoscale (default 4)")
    p.add_argument("--planner-interval", type=float, default=5.0, metavar="S",
                   help="seconds between the planner's decisions with --autoscale (default 5)")
    p.add_argument("--planner-cooldown", type=float, default=30.0, metavar="S",
                   help="seconds a pool waits after a change before the planner changes it again (default 30)")
    p.add_argument("--planner", choices=("threshold", "sla"), default="threshold",
                   help="the --autoscale policy: threshold = one worker at a time on queued prompt tokens and KV "
                        "usage; sla = each pool sized for the SLOs from the observed request rate and lengths "
                        "with --profile's step model (needs --ttft-slo-ms, --tpot-slo-ms, --profile; default "
                        "threshold)")
    p.add_argument("--ttft-slo-ms", type=float, default=None, metavar="MS",
                   help="--planner sla: time-to-first-token SLO (90th percentile) the pools are sized for")
    p.add_argument("--tpot-slo-ms", type=float, default=None, metavar="MS",
                   help="--planner sla: time-per-output-token SLO the pools are sized for")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="--planner sla: profile.json of this model on this hardware (`pdserve profile`)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="Ray CPUs (and torch threads) per worker")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the engines run: cuda gives every worker actor one Ray GPU and moves KV over "
                        "NCCL; auto = cuda when the Ray cluster offers GPUs, else cpu (default auto)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per worker (default: by memory)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="running sequences per decode worker")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="every engine's per-step token budget: prompts longer than N are prefilled in chunks "
                        "(chunked prefill), mixed with decodes (default 2048; `pdserve plan` recommends one)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="turn off the engines' automatic prefix caching (on by default)")
    p.add_argument("--quantization", choices=("int8", "int4", "w8a8", "w4a8"), default=None,  # engine.quant.QUANTIZATIONS
                   help="quantization of every worker's model at load: int8 per output channel, int4 group-wise "
                        "(weight-only), or w8a8 / w4a8 (the same weights, activations rounded to int8 per 32 "
                        "values: integer dot products); default: off, float weights")
    p.add_argument("--quantization-group-size", type=int, default=128, metavar="G",
                   help="inputs per int4 scale, a multiple of 32 (default 128)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                   help="KV cache of every worker: auto = the model dtype, int8 = quantized with per-token, "
                        "per-head scales (about 4x the tokens of float32 in the same memory, and a quarter of "
                        "the bytes shipped from prefill to decode); default auto")
    p.add_argument("--speculative-method", choices=("ngram", "draft_model"), default=None,
                   help="speculative decoding in the decode (and colocated) workers: ngram = prompt-lookup drafts, "
                        "draft_model = a small model's drafts (--speculative-model); drafts are verified in the "
                        "same forward, greedy and seeded output is unchanged (default: off)")
    p.add_argument("--speculative-model", default=None, metavar="MODEL",
                   help="the draft model (a built-in name such as tiny-draft, or a HF directory sharing the "
                        "target's tokenizer); implies --speculative-method draft_model")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="draft tokens per step with --speculative-method or --speculative-model (default 4)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, metavar="N",
                   help="shortest n-gram the ngram drafts look up (default 1)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, metavar="N",
                   help="longest n-gram the ngram drafts look up (default 4)")
    p.add_argument("--check-interval", type=float, default=1.0, metavar="S",
                   help="seconds between the supervisor's health checks of the workers; a dead or stuck "
                        "worker is replaced under a new id (default 1)")


def add_router_args(p: argparse.ArgumentParser) -> None:
    """The public front end: ports, admission, conditional disaggregation, TLS and API keys."""
    p.add_argument("--port", type=int, default=50051, help="router port, 0 = free port (default 50051)")
    p.add_argument("--http-port", type=int, default=8000, metavar="PORT",
                   help="OpenAI-compatible HTTP API port on --host (default 8000; 0 turns it off)")
    p.add_argument("--health-port", type=int, default=0, metavar="PORT",
                   help="a plaintext gRPC port on --host offering only grpc.health.v1, for probes that speak no "
                        "TLS (the kubelet's) when the API serves TLS (default 0: none)")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0, metavar="N",
                   help="conditional disaggregation: prompts of at most N tokens are prefilled on the decode "
                        "worker itself (default 0: always use the prefill pool)")
    p.add_argument("--prefill-queue-max-tokens", type=int, default=None, metavar="N",
                   help="conditional disaggregation: prefill on the decode worker when every prefill worker has "
                        ">= N prompt tokens queued (default: never)")
    p.add_argument("--max-num-requests", type=int, default=None, metavar="N",
                   help="requests the router holds at once (running + queued); past it a request gets "
                        "RESOURCE_EXHAUSTED at once (router default 192; must stay below its 256 RPC threads)")
    sec = p.add_argument_group("public API security", "Secrets are read from files or the environment, never "
                                                      "printed; see docs/security.md.")
    sec.add_argument("--ssl-certfile", default=None, metavar="FILE",
                     help="PEM certificate chain: serve the public gRPC API over TLS (with --ssl-keyfile)")
    sec.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="PEM private key of --ssl-certfile")
    sec.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                     help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    sec.add_argument("--api-key", action="append", default=[], metavar="KEY",
                     help=f"require 'authorization: Bearer KEY' on the public API (repeatable). Visible in ps: "
                          f"prefer ${API_KEY_ENV} (comma-separated keys)")


def add_cluster_args(p: argparse.ArgumentParser, *, ray: bool = True, split: bool = False) -> None:
    """Where the cluster lives: interface, Redis, Ray, namespace, the cluster secret, logging.

    ``split``: a controller or router of a deployment, where Redis, the namespace and the secret are given,
    never made up (every process of the deployment must agree on them)."""
    p.add_argument("--host", default="127.0.0.1",
                   help="address every listener binds: router gRPC and metrics, the embedded Redis and, on a "
                        "local Ray, the workers' gRPC, metrics and gloo (default 127.0.0.1; multi-node: this "
                        "node's own address; a wildcard such as 0.0.0.0 only when given here)")
    p.add_argument("--redis-url", default=None,
                   help=f"{'the deployment' if split else 'external'} Redis, redis://:PASSWORD@host:port/db or "
                        f"rediss:// for TLS (default: ${REDIS_URL_ENV}"
                        + ("; required" if split else ", else a private embedded one with a generated password")
                        + f"); a password on argv is visible in ps: prefer ${REDIS_URL_ENV}")
    if ray:
        p.add_argument("--address", default=None, required=split,
                       help="Ray cluster to join, e.g. auto or ray://head:10001"
                            + ("" if split else " (default: start a private local Ray)"))
    p.add_argument("--namespace", default=None, required=split,
                   help="the deployment: registry namespace" + (" and Ray namespace of its workers" if split
                                                                else " (default: a unique one)"))
    p.add_argument("--cluster-secret-file", default=None, metavar="FILE",
                   help=f"file holding the secret the router presents to the workers (or ${CLUSTER_SECRET_ENV}; "
                        + ("required: every controller and router of the deployment must share it)" if split else
                           "default: a fresh one per run). Give the same one to every launcher of one cluster"))
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for SERVING")
    p.add_argument("--log-level", default="WARNING", help="Python log level (default WARNING)")


def add_serve_commands(sub: argparse._SubParsersAction) -> None:
    """The ``up``, ``controller`` and ``router`` subcommands."""
    p = sub.add_parser("up", help="run a cluster until SIGINT/SIGTERM",
                       description="Start Redis (unless --redis-url), Ray (unless --address), prefill and decode "
                                   "worker actors and the router; stop all of it on SIGINT/SIGTERM.")
    add_model_args(p)
    add_pool_args(p)
    add_router_args(p)
    add_cluster_args(p)
    p = sub.add_parser("controller", help="own a deployment's worker pools (workers outlive it)",
                       description="Take the deployment's controller lease, adopt its live detached workers, start "
                                   "the missing ones, and keep the pools at size (supervisor, --autoscale "
                                   "planner). On SIGINT/SIGTERM the workers keep serving; `pdserve down "
                                   "--address` stops them.")
    add_model_args(p)
    add_pool_args(p)
    add_cluster_args(p, split=True)
    p = sub.add_parser("router", help="a stateless router of a deployment (no Ray)",
                       description="Serve the public gRPC (and HTTP) API for the workers a controller keeps in "
                                   "the deployment's registry. Any number can run; each drains on SIGTERM "
                                   "without touching a worker.")
    add_model_args(p)
    p.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated",
                   help="route to prefill+decode pools or to colocated workers (default disaggregated)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM: NOT_SERVING at once, then up to S seconds for in-flight requests (default 30)")
    add_router_args(p)
    add_cluster_args(p, ray=False, split=True)


# ---- checks -----------------------------------------------------------------------------------------
def _check_model_args(args: argparse.Namespace) -> None:
    if args.model not in BUILTIN_MODELS and not os.path.isdir(args.model):
        raise ValueError(f"--model must be one of {BUILTIN_MODELS} or a model directory, got {args.model!r}")
    if args.served_model_name is not None and (not args.served_model_name.strip()
                                               or not args.served_model_name.isprintable()):
        raise ValueError(f"--served-model-name must be a non-empty printable name, got {args.served_model_name!r}")


def _check_pool_args(args: argparse.Namespace) -> None:
    for name in ("prefill", "decode", "colocated"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.autoscale:
        for name, lo, hi in (("prefill", args.prefill, args.max_prefill), ("decode", args.decode, args.max_decode)):
            if not args.colocated and hi < max(lo, 1):
                raise ValueError(f"--max-{name} must be >= max(--{name}, 1), got {hi}")
    for flag in ("planner_interval", "planner_cooldown"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    args.sla_profile = _check_sla_args(args)
    if not args.check_interval > 0:
        raise ValueError(f"--check-interval must be > 0, got {args.check_interval}")
    from engine.config import EngineConfig

    overrides = _engine_overrides(args, checked_only=True)
    _check_config(EngineConfig, overrides)
    spec = overrides.get("speculative_config") or {}
    if spec.get("method") == "draft_model":  # a bad draft is a flag error now, not a worker crash later
        from engine.loader import load_model_config

        try:
            draft = load_model_config(EngineConfig(model=spec["model"]))
            target = load_model_config(EngineConfig(model=args.model))
        except ValueError as e:
            raise ValueError(f"--speculative-model: {e}") from e
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"--speculative-model {spec['model']!r} has vocab_size {draft.vocab_size}, "
                             f"--model has {target.vocab_size}: a draft must share the target's tokenizer")


def _check_sla_args(args: argparse.Namespace):
    """--planner sla's flags; the loaded profile (a ``simulator.costs.Profile``), or None for --planner
    threshold."""
    if args.planner != "sla":
        for flag in ("ttft_slo_ms", "tpot_slo_ms", "profile"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} is only used by --planner sla")
        return None
    if not args.autoscale:
        raise ValueError("--planner sla needs --autoscale (without it no planner runs)")
    for flag in ("ttft_slo_ms", "tpot_slo_ms", "profile"):
        if getattr(args, flag) is None:
            raise ValueError(f"--planner sla needs --{flag.replace('_', '-')}")
    for flag in ("ttft_slo_ms", "tpot_slo_ms"):
        v = getattr(args, flag)
        if not (v > 0 and v < float("inf")):
            raise ValueError(f"--{flag.replace('_', '-')} must be a number > 0, got {v}")
    from simulator.costs import load_profile

    prof = load_profile(args.profile)  # ValueError naming --profile and the file
    prof.check_matches(model=args.model, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                       where=f"--profile {args.profile}")
    if args.colocated == 0 and "gloo" not in prof.links and "nccl" not in prof.links:
        raise ValueError(f"--profile {args.profile}: has no KV link measurement (taken with --skip-link?); "
                         f"--planner sla needs one to size the decode pool")
    return prof


def _sla_config(args: argparse.Namespace):
    """The ``SlaConfig`` of --planner sla (flags checked by ``_check_sla_args``)."""
    from cluster.sla_planner import SlaConfig
    from engine.config import EngineConfig

    prof, eng = args.sla_profile, EngineConfig
    blocks = args.num_kv_blocks
    kv_tokens = (blocks * prof.block_size if blocks is not None
                 else EngineConfig.kv_cache_memory_bytes // prof.kv_bytes_per_token)
    link = "nccl" if args.device == "cuda" and "nccl" in prof.links else ("gloo" if "gloo" in prof.links
                                                                         else next(iter(prof.links), "gloo"))
    return SlaConfig(profile=prof, ttft_slo_ms=args.ttft_slo_ms, tpot_slo_ms=args.tpot_slo_ms,
                     max_num_batched_tokens=args.max_num_batched_tokens or eng.max_num_batched_tokens,
                     max_num_seqs=args.max_num_seqs or eng.max_num_seqs, kv_tokens=kv_tokens, kv_link=link)


def _check_router_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
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
    if not 0 <= args.health_port < 65536:
        raise ValueError(f"--health-port must be in [0, 65535] (0: none), got {args.health_port}")
    if args.health_port:
        _check_port_free(args.host, args.health_port, "--health-port")
    given = [(f, p) for f, p in (("--port", args.port), ("--http-port", args.http_port),
                                 ("--health-port", args.health_port)) if p]
    for i, (f1, p1) in enumerate(given):
        for f2, p2 in given[i + 1:]:
            if p1 == p2:
                raise ValueError(f"{f2} {p2} is also {f1}: give each listener its own port")
    from router.config import RouterConfig

    _check_config(RouterConfig, _router_overrides(args))


def _check_up_args(args: argparse.Namespace) -> None:
    """Every check of ``pdserve up``'s flags (cheap: before Redis, Ray or a worker starts)."""
    _check_pool_args(args)
    _check_model_args(args)
    _check_router_args(args)


def _check_config(build: Callable, kw: dict) -> None:
    # the fields the configs own are checked by the configs themselves, reported under the flag's name
    try:
        build(**kw)
    except ValueError as e:
        raise _as_flag_error(e, kw) from None


def _engine_overrides(args: argparse.Namespace, checked_only: bool = False) -> dict:
    """The EngineConfig fields the pool flags set."""
    out = {k: v for k, v in (("num_kv_blocks", args.num_kv_blocks), ("max_num_seqs", args.max_num_seqs),
                             ("max_num_batched_tokens", args.max_num_batched_tokens))
           if v is not None}
    if args.no_prefix_caching and not checked_only:
        out["enable_prefix_caching"] = False
    if args.quantization is not None:
        out["quantization"] = args.quantization
        out["quantization_group_size"] = args.quantization_group_size
    if args.kv_cache_dtype != "auto":
        out["kv_cache_dtype"] = args.kv_cache_dtype
    method = args.speculative_method or ("draft_model" if args.speculative_model else None)
    if method == "ngram":
        out["speculative_config"] = {"method": method, "num_speculative_tokens": args.num_speculative_tokens,
                                     "prompt_lookup_min": args.prompt_lookup_min,
                                     "prompt_lookup_max": args.prompt_lookup_max}
        if args.speculative_model:
            out["speculative_config"]["model"] = args.speculative_model  # refused by the config, by name
    elif method == "draft_model":
        out["speculative_config"] = {"method": method, "num_speculative_tokens": args.num_speculative_tokens,
                                     "model": args.speculative_model}
    return out


def _router_overrides(args: argparse.Namespace) -> dict:
    """The RouterConfig fields the router flags set."""
    out = {"local_prefill_max_tokens": args.local_prefill_max_tokens,
           "prefill_queue_max_tokens": args.prefill_queue_max_tokens}
    if args.max_num_requests is not None:
        out["max_num_requests"] = args.max_num_requests
    out["http_port"] = args.http_port or None  # 0: no HTTP API
    out["health_port"] = args.health_port or None
    return out


def _as_flag_error(e: ValueError, fields: dict) -> ValueError:
    """A config's "field must be ..." error, named by the command-line flag that set the field."""
    msg = str(e)
    if msg.startswith("speculative_config.") and "speculative_config" in fields:  # its keys are flags too
        rest = msg[len("speculative_config."):]
        name = rest.split(" ", 1)[0]
        flag = {"method": "--speculative-method", "model": "--speculative-model"}.get(
            name, "--" + name.replace("_", "-"))
        return ValueError(flag + rest[len(name):])
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


# ---- secrets ----------------------------------------------------------------------------------------
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
    keys = list(getattr(args, "api_key", []))
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


def _split_secrets(args: argparse.Namespace) -> tuple[tuple[str, ...], str, str]:
    """``_up_secrets`` for a controller or router: the Redis URL and the cluster secret are required."""
    keys, secret, redis_url = _up_secrets(args)
    if redis_url is None:
        raise ValueError(f"--redis-url (or ${REDIS_URL_ENV}) is required: the deployment's Redis")
    if secret is None:
        raise ValueError(f"--cluster-secret-file (or ${CLUSTER_SECRET_ENV}) is required: every controller and "
                         f"router of a deployment must share one cluster secret")
    return keys, secret, redis_url


# ---- readiness ----------------------------------------------------------------------------------------
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


def _wait_router(address: str, args: argparse.Namespace) -> None:
    if args.ssl_certfile is None:
        wait_serving(address, args.ready_timeout)
    else:
        # The router reported SERVING in-process when it started. A gRPC probe over its TLS port would need
        # to verify the router's certificate (issued by a CA this process may not hold) and, with mutual
        # TLS, a client certificate: check that the port answers instead.
        _wait_listening(address, args.ready_timeout)


# ---- running ------------------------------------------------------------------------------------------
def run_until_signal(start: Callable[[], None], ready: Callable[[], None], stop: Callable[[], None],
                     failed: Callable[[], Optional[str]] = lambda: None) -> int:
    """``start()``, ``ready()``, then block until SIGINT/SIGTERM or until ``failed()`` names a reason (polled
    every second), then ``stop()``. A signal during start aborts it the same way. Returns 0, or 1 when
    ``failed()`` ended the run."""
    stop_event = threading.Event()
    stopping = False
    reason: Optional[str] = None

    def on_signal(signum: int, _frame) -> None:
        if stopping:
            return  # already tearing down: let it finish
        stop_event.set()
        raise _Shutdown(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        start()
        # ray.init installs its own SIGTERM handler (sys.exit(15)); take SIGTERM back for a clean stop.
        for s in previous:
            signal.signal(s, on_signal)
        ready()
        while not stop_event.wait(1.0):
            reason = failed()
            if reason:
                print(f"pdserve: {reason}, stopping", file=sys.stderr, flush=True)
                break
    except _Shutdown as e:
        print(f"pdserve: {e}, stopping", file=sys.stderr, flush=True)
    except SystemExit as e:
        if e.code != signal.SIGTERM:  # Ray's handler fired while the cluster was still starting
            raise
        print("pdserve: SIGTERM, stopping", file=sys.stderr, flush=True)
    finally:
        stopping = True
        try:
            stop()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    print("pdserve: stopped", file=sys.stderr, flush=True)
    return 1 if reason else 0


def _pool_config_kwargs(args: argparse.Namespace) -> dict:
    if args.colocated:  # one mode per router: colocated replaces the two pools
        args.prefill = args.decode = 0
    return dict(model=args.model, served_model_name=args.served_model_name, num_prefill=args.prefill,
                num_decode=args.decode, num_colocated=args.colocated, host=args.host, ray_address=args.address,
                namespace=args.namespace, cpus_per_worker=args.cpus_per_worker, device=args.device,
                engine_overrides=_engine_overrides(args))


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
            sla=_sla_config(args) if args.planner == "sla" else None),
            supervisor=supervisor).start()
    return supervisor, planner


def _stop_loops(loops: list) -> None:
    for loop in loops:
        if loop is not None:
            loop.stop(wait=False)  # cluster.stop() interrupts a scale it may be in


def _secret_source(args: argparse.Namespace, secret: Optional[str]) -> str:
    return "file" if args.cluster_secret_file else "environment" if secret else "generated for this run"


def cmd_up(args: argparse.Namespace) -> int:
    """``pdserve up``: run until a signal, then stop everything that was started."""
    # Ray's driver otherwise installs a C++ "failure" handler for SIGTERM that aborts the process
    # before our handler can stop the cluster cleanly. Ray reads it at import, hence before the import.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    from cluster.launcher import Cluster, ClusterConfig

    _check_up_args(args)
    api_keys, cluster_secret, redis_url = _up_secrets(args)
    cfg = ClusterConfig(**_pool_config_kwargs(args), router_port=args.port, redis_url=redis_url,
                        router_overrides=_router_overrides(args), api_keys=api_keys,
                        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
                        cluster_secret=cluster_secret)
    cluster = Cluster(cfg)

    def ready(planner) -> None:
        _wait_router(cluster.router_address, args)
        _print_endpoints(cluster, planner, args, _secret_source(args, cluster_secret))

    return _run_cluster(cluster, args, ready)


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

    _check_pool_args(args)
    _check_model_args(args)
    _, cluster_secret, redis_url = _split_secrets(args)
    cfg = ClusterConfig(**_pool_config_kwargs(args), redis_url=redis_url, cluster_secret=cluster_secret,
                        detached=True, router_factory=False, start_timeout_s=args.ready_timeout)
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
        return "another controller took the deployment's lease" if cluster.lease_lost else None

    return _run_cluster(cluster, args, ready, failed)


def cmd_router(args: argparse.Namespace) -> int:
    """``pdserve router``: serve the public API for a deployment's workers until a signal."""
    from cluster.config import ClusterConfig, build_router
    from cluster.registry import Registry

    _check_model_args(args)
    _check_router_args(args)
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    api_keys, cluster_secret, redis_url = _split_secrets(args)
    colocated = args.mode == "colocated"
    # A router reads pools; the config's pool sizes only pick its mode.
    cfg = ClusterConfig(model=args.model, served_model_name=args.served_model_name, num_prefill=0, num_decode=0,
                        num_colocated=int(colocated), host=args.host, router_port=args.port, redis_url=redis_url,
                        namespace=args.namespace, router_overrides=_router_overrides(args), api_keys=api_keys,
                        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, ssl_ca_certs=args.ssl_ca_certs,
                        cluster_secret=cluster_secret)
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
    lines.append(f"  cluster  workers accept only the cluster secret ({secret_source})")
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
