"""The ``pdserve`` command: ``up``/``controller``/``router`` serve, ``down`` cleans up, ``generate``, ``bench``,
``profile``.

The serving commands live in ``cluster.serve_cli`` (its docstring tells their
lifecycles; their flags in ``cluster.up_flags``): ``up`` runs a whole cluster in one process; ``controller`` and
``router`` run one deployment split, workers outliving both.

``pdserve down --namespace NS --redis-url URL`` removes what a SIGKILLed
``pdserve up`` left in Redis (see its ``--help`` for what Ray leaves); with
``--address RAY`` it first stops the deployment's detached workers (the
teardown of a ``pdserve controller`` deployment).

``pdserve generate PROMPT`` is a thin client of the public API (streams text
deltas to stdout); ``pdserve lora {list,load,unload}`` another (the LoRA adapters a cluster serves, loaded and
unloaded at run time: router/lora_admin.py); ``pdserve bench ...`` hands its arguments to
``loadtest.cli.main``; ``pdserve profile ...`` (measure this machine's step, KV
link and router costs into ``profile.json``) to ``simulator.profile.main``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from cluster.serve_cli import cmd_controller, cmd_router, cmd_up
from cluster.up_flags import add_serve_commands
from cluster.up_secrets import REDIS_URL_ENV, redis_url_from_args
from transport.client_auth import add_client_auth_args, client_auth_from_args


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running cluster")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--target", default="127.0.0.1:50051", help="router host:port (default 127.0.0.1:50051)")
    p.add_argument("--model", default="", metavar="NAME",
                   help="a LoRA adapter the cluster serves (pdserve up --lora-modules); default: the base model")
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


def _add_lora(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lora", help="list, load or unload a running cluster's LoRA adapters")
    p.add_argument("action", choices=("list", "load", "unload"),
                   help="list: the adapters served; load NAME PATH / unload NAME: at run time (the router must run "
                        "with --allow-runtime-lora-updating)")
    p.add_argument("name", nargs="?", default=None, help="the adapter's name (load, unload)")
    p.add_argument("path", nargs="?", default=None,
                   help="load: the PEFT adapter directory, on every worker's host (a relative PATH is made "
                        "absolute here)")
    p.add_argument("--target", default="127.0.0.1:50051", help="router host:port (default 127.0.0.1:50051)")
    p.add_argument("--timeout", type=float, default=180.0,
                   help="seconds to wait for the cluster (a load waits for every worker; default 180)")
    add_client_auth_args(p)


def cmd_lora(args: argparse.Namespace) -> int:
    """``pdserve lora``: the router's ``GetModelInfo`` / ``LoadLoRAAdapter`` / ``UnloadLoRAAdapter``."""
    import grpc

    from proto import pdserve_pb2, pdserve_pb2_grpc

    if args.action == "list" and (args.name or args.path):
        raise ValueError("list takes no NAME or PATH")
    if args.action in ("load", "unload") and not args.name:
        raise ValueError(f"{args.action} needs the adapter's NAME")
    if args.action == "unload" and args.path:
        raise ValueError("unload takes NAME only")
    if args.action == "load":
        if not args.path:
            raise ValueError("load needs NAME and PATH (the adapter directory on the workers' hosts)")
        args.path = os.path.abspath(args.path)  # (the workers read it: say it whole)
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    auth = client_auth_from_args(args)
    with auth.channel(args.target) as ch:
        stub = pdserve_pb2_grpc.PDServeStub(ch)
        kw = dict(timeout=args.timeout, metadata=auth.metadata())
        try:
            if args.action == "list":
                info = stub.GetModelInfo(pdserve_pb2.GetModelInfoRequest(), **kw)
                for name in info.lora_adapters:
                    print(name)
                return 0
            if args.action == "load":
                r = stub.LoadLoRAAdapter(pdserve_pb2.LoadLoRAAdapterRequest(lora_name=args.name,
                                                                          lora_path=args.path), **kw)
            else:
                r = stub.UnloadLoRAAdapter(pdserve_pb2.UnloadLoRAAdapterRequest(lora_name=args.name), **kw)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(r.message)
    return 0


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
    p.add_argument("--address", default=None,
                   help="the Ray cluster of a `pdserve controller` deployment: stop its detached workers first "
                        "(they keep the namespace's keys alive otherwise)")
    p.add_argument("--wait", type=float, default=15.0, metavar="S",
                   help="seconds to wait for the dead run's worker records to expire (default 15)")


def cmd_down(args: argparse.Namespace) -> int:
    """``pdserve down``: delete a dead run's keys from Redis and list them on stdout."""
    from cluster.registry import Registry

    if not args.wait >= 0:
        raise ValueError(f"--wait must be >= 0, got {args.wait}")
    redis_url = redis_url_from_args(args)
    if redis_url is None:
        raise ValueError(f"--redis-url (or ${REDIS_URL_ENV}) is required")
    with Registry(redis_url, args.namespace) as reg:
        reg.ping()
        if args.address:
            for worker_id in _stop_detached(args.address, args.namespace):
                print(f"stopped worker {worker_id}")
        keys = reg.clear_stale(wait_s=args.wait)
    for key in keys:
        print(f"removed {key}")
    print(f"pdserve down: removed {len(keys)} key(s) of namespace {args.namespace}", flush=True)
    return 0


def _stop_detached(address: str, namespace: str) -> list[str]:
    """Kill the deployment's detached worker actors (named in Ray namespace ``namespace``); their ids."""
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    import ray

    from cluster.ownership import detached_workers

    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="WARNING")
    try:
        workers = detached_workers(namespace)
        for handle in workers.values():
            ray.kill(handle, no_restart=True)
        return sorted(workers)
    finally:
        ray.shutdown()


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve`` argument parser (``bench`` is parsed by loadtest)."""
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{up,controller,router,down,generate,lora,bench,profile,roofline,simulate,plan}")
    add_serve_commands(sub)
    _add_down(sub)
    _add_generate(sub)
    _add_lora(sub)
    sub.add_parser("bench", help="load-test a running cluster (see `pdserve bench --help`)", add_help=False)
    sub.add_parser("profile", help="measure this machine's step, KV link and router costs into profile.json "
                                   "(see `pdserve profile --help`)", add_help=False)
    sub.add_parser("roofline", help="write a profile from a model's shape and a device's datasheet, for hardware "
                                    "you cannot measure (see `pdserve roofline --help`)", add_help=False)
    sub.add_parser("simulate", help="simulate a deployment on a profile (see `pdserve simulate --help`)",
                   add_help=False)
    sub.add_parser("plan", help="size a deployment for a workload and SLOs (see `pdserve plan --help`)",
                   add_help=False)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    """``pdserve generate``: stream one completion's text to stdout."""
    import grpc

    from proto import pdserve_pb2, pdserve_pb2_grpc

    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    req = pdserve_pb2.GenerateRequest(prompt=args.prompt, stop=args.stop, ignore_eos=args.ignore_eos, model=args.model)
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


_COMMANDS = {"up": cmd_up, "controller": cmd_controller, "router": cmd_router}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``pdserve`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from loadtest.cli import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "profile":
        from simulator.profile import main as profile_main

        return profile_main(argv[1:])
    if argv and argv[0] == "roofline":
        from simulator.roofline import main as roofline_main

        return roofline_main(argv[1:])
    if argv and argv[0] == "simulate":
        from simulator.cli import main as simulate_main

        return simulate_main(argv[1:])
    if argv and argv[0] == "plan":
        from simulator.plan import main as plan_main

        return plan_main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help or a usage error
        return int(e.code or 0)
    level = getattr(args, "log_level", "WARNING")
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.WARNING), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command in _COMMANDS:
            return _COMMANDS[args.command](args)
        if args.command == "down":
            return cmd_down(args)
        if args.command == "lora":
            return cmd_lora(args)
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
