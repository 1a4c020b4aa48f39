"""The checks of ``pdserve up``, ``controller`` and ``router``'s flags: every one before anything starts.

Lifecycle: a command calls ``check_up_args`` (or the parts a split command needs:
``check_model_args``, ``check_pool_args``, ``check_router_args``) right after parsing, so bad
input fails in a second with exit status 2 and a ``ValueError`` that names the flag, never
after Redis, Ray or a worker has started. The fields the configs own are checked by the configs
themselves (``check_config`` builds one) and their messages are renamed to the flag that set the
field (``as_flag_error``); a port is checked by ``transport.ports.check_port`` and, when given,
bound once to see that it is free. ``check_pool_args`` leaves the loaded ``--profile`` of
``--planner sla`` on ``args.sla_profile``.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Callable

from cluster.up_flags import engine_overrides, router_overrides
from transport.ports import check_port

BUILTIN_MODELS = ("tiny", "bench")


def check_up_args(args: argparse.Namespace) -> None:
    """Every check of ``pdserve up``'s flags (cheap: before Redis, Ray or a worker starts)."""
    check_pool_args(args)
    check_model_args(args)
    check_router_args(args)


def encoder_pools(args: argparse.Namespace) -> bool:
    """An encoder (engine/encoder.py) does only prefill work: its embeddings and scores run where prompts run, and a
    decode worker would hold a model it never uses. So ``pdserve up`` with one runs its --prefill + --decode workers
    as one colocated pool (unless --colocated says how many); True where it changed ``args`` (said on stderr)."""
    if args.colocated or args.model in BUILTIN_MODELS:
        return False
    from engine.config import EngineConfig
    from engine.loader import load_model_config

    if not load_model_config(EngineConfig(model=args.model)).is_encoder:
        return False
    args.colocated = max(1, args.prefill + args.decode)
    print(f"pdserve up: {args.model} is an encoder (embeddings and scores are prompt work): running "
          f"{args.colocated} colocated worker(s) instead of prefill and decode pools (--colocated K sets it)",
          file=sys.stderr)
    return True


def check_model_args(args: argparse.Namespace) -> None:
    """--model (a built-in name or a directory), --served-model-name, --max-model-len and --lora-modules (each
    adapter read and checked against the model's shapes)."""
    if args.model not in BUILTIN_MODELS and not os.path.isdir(args.model):
        raise ValueError(f"--model must be one of {BUILTIN_MODELS} or a model directory, got {args.model!r}")
    if args.served_model_name is not None and (not args.served_model_name.strip()
                                               or not args.served_model_name.isprintable()):
        raise ValueError(f"--served-model-name must be a non-empty printable name, got {args.served_model_name!r}")
    if args.model not in BUILTIN_MODELS:  # (a quantized checkpoint the engine cannot load: said before anything starts)
        from engine.prequantized import read_prequantized_dir

        try:
            spec = read_prequantized_dir(args.model)
        except ValueError as e:
            raise ValueError(f"--model {args.model}: {e}") from None
        if spec is not None and getattr(args, "quantization", None):
            raise ValueError(f"--quantization: {args.model} is a {spec.describe()} checkpoint, served as it is "
                             "(leave --quantization unset)")
    n = getattr(args, "max_model_len", None)
    if n is not None:
        if n < 2:  # one prompt token and one output token
            raise ValueError(f"--max-model-len must be >= 2, got {n}")
        from engine.config import EngineConfig
        from engine.loader import load_model_config

        positions = load_model_config(EngineConfig(model=args.model)).max_position_embeddings
        if n > positions:  # as vLLM: the model was not trained for positions past its own
            raise ValueError(f"--max-model-len {n} is longer than the model's max_position_embeddings ({positions})")
        block = EngineConfig.block_size
        for flag in ("--num-kv-blocks", "--prefill-num-kv-blocks", "--decode-num-kv-blocks"):
            blocks = getattr(args, flag[2:].replace("-", "_"), None)
            if blocks is not None and blocks * block < n:  # each engine would refuse to start (engine.llm_engine)
                raise ValueError(f"--max-model-len {n} does not fit {flag} {blocks} ({blocks * block} tokens of "
                                 f"{block}-token blocks): one sequence of --max-model-len must fit a worker's cache")
    if getattr(args, "lora_modules", None):
        from engine.config import EngineConfig
        from engine.loader import load_model_config
        from engine.lora import load_adapter, parse_lora_modules
        from engine.names import default_served_model_name

        try:
            modules = parse_lora_modules(args.lora_modules)
            served = args.served_model_name or default_served_model_name(args.model)
            if served in modules:
                raise ValueError(f"adapter name {served!r} is the served model name")
            mc = load_model_config(EngineConfig(model=args.model))
            for name, path in modules.items():
                load_adapter(name, path, mc)
        except ValueError as e:
            raise ValueError(f"--lora-modules: {str(e).removeprefix('lora_modules: ')}") from None


def check_pool_args(args: argparse.Namespace) -> None:
    """The pool flags: sizes, planner bounds and policy, supervisor, the engine fields (by ``EngineConfig``) and
    a draft model's vocabulary; sets ``args.sla_profile``."""
    for name in ("prefill", "decode", "colocated"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.engine_process and args.device == "cuda" and (args.prefill or args.decode or args.autoscale):
        raise ValueError("--engine-process with prefill or decode workers needs --device cpu: their engine process "
                         "shares its KV cache with the worker through shared memory (a CUDA cache is not shared "
                         "between the engine process and its worker)")
    if not 0 < getattr(args, "gpus_per_worker", 1.0) <= 1:
        raise ValueError(f"--gpus-per-worker must be in (0, 1], got {args.gpus_per_worker:g}")
    if args.autoscale:
        for name, lo, hi in (("prefill", args.prefill, args.max_prefill), ("decode", args.decode, args.max_decode)):
            if not args.colocated and hi < max(lo, 1):
                raise ValueError(f"--max-{name} must be >= max(--{name}, 1), got {hi}")
    for flag in ("prefill_num_kv_blocks", "decode_num_kv_blocks"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    for flag in ("planner_interval", "planner_cooldown"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    args.sla_profile = check_sla_args(args)
    if not args.check_interval > 0:
        raise ValueError(f"--check-interval must be > 0, got {args.check_interval}")
    from engine.config import EngineConfig

    try:
        overrides = engine_overrides(args, checked_only=True)
    except ValueError as e:  # (--lora-modules' entries are parsed there)
        raise as_flag_error(e, {"lora_modules": None}) from None
    if overrides.get("async_scheduling") and getattr(args, "device", None) != "cuda":
        raise ValueError("--async-scheduling needs --device cuda: it overlaps the host's work with a GPU's decode "
                         "steps (a CPU forward runs on the thread that schedules)")
    # an explicit --device cuda is checked as the workers will be (batch_invariant's limits are CUDA's)
    check_config(EngineConfig, {**overrides, "device": "cuda"} if getattr(args, "device", None) == "cuda" else overrides)
    check_pool_tp(args)
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


def check_pool_tp(args: argparse.Namespace) -> None:
    """--tensor-parallel-size, --prefill-tp, --decode-tp: each pool's split must fit the model and this node."""
    from engine.config import EngineConfig
    from engine.loader import load_model_config
    from engine.tensor_parallel import check_tensor_parallel

    pools = [("--tensor-parallel-size", args.tensor_parallel_size)]
    pools += [(flag, n) for flag, n in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp))
              if n is not None]
    if all(n == 1 for _, n in pools):
        return
    if args.engine_process and args.tensor_parallel_size != 1:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} cannot be combined with "
                         "--engine-process: the engine process cannot start rank processes")
    mc = load_model_config(EngineConfig(model=args.model))
    for flag, n in pools:
        check_tensor_parallel(mc, n, device="cpu" if args.device == "auto" else args.device,
                              quantization=args.quantization, group_size=args.quantization_group_size, flag=flag)


def check_sla_args(args: argparse.Namespace):
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


def check_router_args(args: argparse.Namespace) -> None:
    """The router flags: ports (valid, free, one per listener), TLS files, the ``RouterConfig`` fields."""
    check_port(args.port, "--port")
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise ValueError("--ssl-certfile and --ssl-keyfile must be given together")
    if args.ssl_ca_certs is not None and args.ssl_certfile is None:
        raise ValueError("--ssl-ca-certs (mutual TLS) needs --ssl-certfile and --ssl-keyfile")
    for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path is not None and not os.access(path, os.R_OK):
            raise ValueError(f"{flag}: cannot read {path!r}")
    if getattr(args, "api_keys_file", None):
        from transport.api_keys import KeysFile

        try:
            KeysFile(args.api_keys_file)
        except ValueError as e:
            raise ValueError(f"--api-keys-file: {e}") from None
    if args.port:
        check_port_free(args.host, args.port)
    check_port(args.http_port, "--http-port", zero_means="the HTTP API is off")
    if args.http_port:
        check_port_free(args.host, args.http_port, "--http-port")
    check_port(args.health_port, "--health-port", zero_means="none")
    if args.health_port:
        check_port_free(args.host, args.health_port, "--health-port")
    given = [(f, p) for f, p in (("--port", args.port), ("--http-port", args.http_port),
                                 ("--health-port", args.health_port)) if p]
    for i, (f1, p1) in enumerate(given):
        for f2, p2 in given[i + 1:]:
            if p1 == p2:
                raise ValueError(f"{f2} {p2} is also {f1}: give each listener its own port")
    from router.config import RouterConfig

    check_config(RouterConfig, router_overrides(args))


def check_config(build: Callable, kw: dict) -> None:
    """``build(**kw)``; its ``ValueError`` renamed by flag (the fields the configs own are checked by the
    configs themselves, reported under the flag's name)."""
    try:
        build(**kw)
    except ValueError as e:
        raise as_flag_error(e, kw) from None


def as_flag_error(e: ValueError, fields: dict) -> ValueError:
    """A config's "field must be ..." error, named by the command-line flag that set the field."""
    msg = str(e)
    if msg.startswith("speculative_config.") and "speculative_config" in fields:  # its keys are flags too
        rest = msg[len("speculative_config."):]
        name = rest.split(" ", 1)[0]
        flag = {"method": "--speculative-method", "model": "--speculative-model"}.get(
            name, "--" + name.replace("_", "-"))
        return ValueError(flag + rest[len(name):])
    for name in fields:
        if msg.startswith((name + " ", name + ":")):
            return ValueError("--" + name.replace("_", "-") + msg[len(name):])
    return e


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """ValueError naming ``flag`` unless ``port`` can be bound on ``host`` now."""
    # Fail in a second, not after Ray and the workers have started (the router binds last).
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # As the servers themselves bind (gRPC and uvicorn set SO_REUSEADDR): a port whose last owner was killed
        # keeps its connections in TIME_WAIT for a minute, and a restarted router must still get it (a listener
        # on the port still makes the bind fail).
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ValueError(f"{flag} {port} on {host} is not available: {e.strerror}") from None
