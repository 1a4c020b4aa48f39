"""`pdserve bench`: replay a trace or synthetic load against a PDServe endpoint and report latencies.

Lifecycle: ``main(argv)`` parses the flags, asks the target for its
``ModelInfo`` (vocabulary and limits), builds the workload (trace rows scaled
by ``--length-scale`` / ``--time-scale``, or synthetic lengths), fixes every
send time up front (trace timestamps, or Poisson/gamma arrivals at
``--request-rate``), runs it with a live progress bar, then prints the summary
table and optionally saves the result JSON and plots. It returns 0 when at
least one request completed, 1 when none did, 2 on bad input or an unreachable
target. ``cluster.cli`` dispatches ``pdserve bench ...`` here.

Example::

    pdserve bench --target localhost:50051 --trace ../shared/traces/azure_llm_2023_conv.csv \\
        --num-prompts 200 --length-scale 0.1 --time-scale 0.5 --save-result out/conv.json --plot out/
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
import uuid
from pathlib import Path
from typing import Optional

import grpc
from tqdm import tqdm

from loadtest.arrivals import gamma_arrivals, trace_arrivals
from loadtest.auth import add_client_auth_args, client_auth_from_args
from loadtest.client import ClientConfig, check_target, fetch_model_info, limits_from_info, run_benchmark
from loadtest.report import print_summary, save_result, write_plots
from loadtest.stats import parse_goodput, summarize
from loadtest.trace import load_trace, scale_trace
from loadtest.workload import build_workload, synthetic_lengths, trace_lengths

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="localhost:50051",
                   help="HOST:PORT of the router (default localhost:50051, where `pdserve up` puts it)")
    add_client_auth_args(p)
    src = p.add_argument_group("workload")
    src.add_argument("--trace", help="CSV trace (TIMESTAMP, ContextTokens, GeneratedTokens) to replay")
    src.add_argument("--trace-start", type=int, default=0, help="first trace row to replay (0-based)")
    src.add_argument("--length-scale", type=float, default=1.0, help="multiply trace prompt/output lengths")
    src.add_argument("--time-scale", type=float, default=1.0,
                     help="multiply trace inter-arrival times (<1 = faster)")
    src.add_argument("--input-len", type=int, default=128, help="synthetic prompt length")
    src.add_argument("--output-len", type=int, default=32, help="synthetic output length")
    src.add_argument("--range-ratio", type=float, default=0.0,
                     help="synthetic lengths uniform in [L*(1-r), L*(1+r)]")
    src.add_argument("--num-prompts", type=int, default=100, help="requests to send (trace rows to replay)")
    src.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=None,
                      help="mean req/s (default: inf, or the trace's own timing with --trace)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier")
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    load.add_argument("--request-timeout", type=float, default=600.0, help="deadline of each request (s)")
    load.add_argument("--ready-timeout", type=float, default=30.0,
                      help="how long to wait for the target to answer GetModelInfo (s)")
    out = p.add_argument_group("output")
    out.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 (e2el too)")
    out.add_argument("--percentiles", default="99", help="comma-separated percentiles to report")
    out.add_argument("--save-result", metavar="FILE.json", help="write the result JSON here")
    out.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def _settings(args: argparse.Namespace, info, request_rate: Optional[float], num_sent: int,
              num_clipped: int) -> dict:
    s = {"target": args.target, "model_id": info.model_name, "mode": info.mode,
         "num_prompts": num_sent, "request_rate": request_rate if request_rate is not None else "trace",
         "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
         "temperature": args.temperature, "num_clipped_to_model_limits": num_clipped}
    if args.trace:
        s.update(dataset="trace", trace=args.trace, trace_start=args.trace_start,
                 length_scale=args.length_scale, time_scale=args.time_scale)
    else:
        s.update(dataset="random", input_len=args.input_len, output_len=args.output_len,
                 range_ratio=args.range_ratio)
    if isinstance(s["request_rate"], float) and math.isinf(s["request_rate"]):
        s["request_rate"] = "inf"  # JSON has no Infinity
    return s


async def _bench(args: argparse.Namespace) -> int:
    try:
        percentiles = [float(x) for x in args.percentiles.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"percentiles must be comma-separated numbers, got {args.percentiles!r}") from None
    if not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(f"percentiles must be within [0, 100], got {args.percentiles!r}")
    slos = parse_goodput(args.goodput)
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {args.num_prompts}")
    try:
        info = await fetch_model_info(args.target, timeout_s=args.ready_timeout, auth=args.auth)
    except grpc.aio.AioRpcError as e:
        print(f"error: target {args.target} unreachable: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    limits = limits_from_info(info)

    request_rate = args.request_rate
    if args.trace:
        rows = scale_trace(load_trace(args.trace, args.trace_start, args.num_prompts),
                           args.length_scale, args.time_scale)
        lengths = trace_lengths(rows)
        arrivals = (trace_arrivals([r.arrival_s for r in rows]) if request_rate is None
                    else gamma_arrivals(len(rows), request_rate, args.burstiness, args.seed))
    else:
        lengths = synthetic_lengths(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
        request_rate = math.inf if request_rate is None else request_rate
        arrivals = gamma_arrivals(len(lengths), request_rate, args.burstiness, args.seed)
    # A unique prefix keeps request ids (and so server logs) of concurrent benches apart.
    workload = build_workload(lengths, arrivals, limits, seed=args.seed, id_prefix=f"bench-{uuid.uuid4().hex[:8]}")
    if workload.num_clipped:
        log.warning("%d of %d requests clipped to the model's limits (context %d, prompt %d, new %d)",
                    workload.num_clipped, len(lengths), limits.max_context_length, limits.max_prompt_tokens,
                    limits.max_new_tokens)
    cfg = ClientConfig(target=args.target, temperature=args.temperature,
                       max_concurrency=args.max_concurrency, request_timeout_s=args.request_timeout,
                       auth=args.auth)

    with tqdm(total=len(workload.requests), disable=args.disable_tqdm, desc="bench", unit="req") as bar:
        records, duration = await run_benchmark(cfg, workload.requests, on_done=lambda _r: bar.update(1))

    settings = _settings(args, info, request_rate, len(workload.requests), workload.num_clipped)
    summary = summarize(records, duration, percentiles, slos or None)
    print_summary(summary, settings)
    if args.save_result:
        path = save_result(args.save_result, summary, settings, records)
        print(f"result saved to {path}")
    if args.plot:
        if args.trace:
            title = f"{Path(args.trace).name} (length x{args.length_scale}, time x{args.time_scale})"
        else:
            title = f"random in={args.input_len} out={args.output_len} @ {settings['request_rate']} req/s"
        for path in write_plots(args.plot, records, title):
            print(f"plot saved to {path}")
    # Group failures by status (the text before ':'), with one example each: ids make every message unique.
    examples: dict[str, str] = {}
    for kind, n in summary["error_counts"].items():
        examples[kind] = next(r.error for r in records if r.error.split(":", 1)[0] == kind)
        print(f"{n} request(s) failed with {kind}, e.g. {examples[kind]}", file=sys.stderr)
    return 0 if summary["completed"] > 0 else 1


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of `pdserve bench`; returns the process exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help or a parse error; callers get a status, not an exception
        return int(e.code or 0)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        check_target(args.target)
        args.auth = client_auth_from_args(args)
        args.auth.credentials()  # an unreadable --ssl-* file is bad input (exit 2), found before any call
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {args.max_concurrency}")
        return asyncio.run(_bench(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # asyncio.run has cancelled every in-flight call by now
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
