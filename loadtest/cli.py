"""`pdserve bench`: replay a trace or synthetic load against a PDServe endpoint and report latencies.

Lifecycle: ``main(argv)`` parses the flags, asks the target for what it serves
(gRPC ``GetModelInfo``: vocabulary and limits; or, with ``--backend openai``,
``GET /v1/models`` plus the vocabulary of ``--tokenizer`` / ``--vocab-size``),
builds the workload (trace rows scaled by ``--length-scale`` / ``--time-scale``,
or random lengths, optionally behind a shared ``--random-prefix-len`` prefix),
fixes every send time up front (trace timestamps, Poisson/gamma arrivals at
``--request-rate``, or a ``--ramp-up-strategy``), sends ``--num-warmups``
uncounted requests, runs the workload with a live progress bar, then prints the
summary table and optionally saves the result JSON (vLLM's keys and file name)
and plots. Both backends fill the same ``RequestRecord``s, so the statistics and
reports are shared. It returns 0 when at least one request completed, 1 when
none did, 2 on bad input or an unreachable target. ``cluster.cli`` dispatches
``pdserve bench ...`` here. The flags a ``vllm bench serve`` user reaches for
keep vLLM's names and meanings.

Example::

    pdserve bench --target localhost:50051 --trace tests/data/azure_llm_2023_conv_first400.csv \\
        --num-prompts 200 --length-scale 0.1 --time-scale 0.5 --save-result out/conv.json --plot out/
    pdserve bench --backend openai --base-url http://localhost:8000 --tokenizer engine/assets/tokenizer \\
        --dataset-name random --random-input-len 64 --random-prefix-len 32 --num-prompts 50 --save-result
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
import uuid
from pathlib import Path
from typing import Any, Optional

import grpc
from tqdm import tqdm

from loadtest.arrivals import RAMP_UP_STRATEGIES, check_ramp_up, gamma_arrivals, ramp_up_arrivals, trace_arrivals
from transport.client_auth import add_client_auth_args, client_auth_from_args
from loadtest.client import ClientConfig, check_target, fetch_model_info, limits_from_info, run_benchmark
from loadtest.openai_client import check_base_url, fetch_openai_info, run_openai_benchmark
from loadtest.report import default_result_name, print_summary, save_result, write_plots
from loadtest.stats import parse_goodput, parse_percentile_metrics, summarize
from loadtest.trace import load_trace, scale_trace
from loadtest.workload import (BenchRequest, ModelLimits, assign_models, build_workload, synthetic_lengths,
                               trace_lengths)

log = logging.getLogger(__name__)

BACKENDS = ("grpc", "openai", "openai-embeddings")
BACKEND_NAMES = {"grpc": "pdserve-grpc", "openai": "openai", "openai-embeddings": "openai-embeddings"}
"""What ``backend`` in the result JSON says (vLLM writes its ``--backend`` there)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=BACKENDS, default="grpc",
                   help="front end to load: grpc (pdserve's Generate at --target), openai "
                        "(POST /v1/completions at --base-url) or openai-embeddings (POST /v1/embeddings there); "
                        "default grpc")
    p.add_argument("--target", default="localhost:50051",
                   help="HOST:PORT of the router's gRPC API (default localhost:50051, where `pdserve up` puts it)")
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="http(s)://HOST:PORT of an OpenAI-compatible server (--backend openai), e.g. "
                        "http://localhost:8000")
    p.add_argument("--model", default=None,
                   help="model name sent with --backend openai (default: the first of GET /v1/models)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapters the target serves: each request names one of them, drawn at random "
                        "(seeded by --seed), as vLLM's serving benchmark does")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer.json, or a folder holding one, whose vocabulary random prompts draw from "
                        "(--backend openai; the HTTP API does not report it)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="draw random prompt ids from [0, N) (--backend openai; instead of --tokenizer)")
    p.add_argument("--pdserve-timings", action="store_true",
                   help="--backend openai against pdserve: ask for its TTFT phases (the pdserve_timings extension) "
                        "and print their percentiles, as the gRPC backend always does")
    add_client_auth_args(p)
    _, load, out = add_workload_args(p)  # the client-only flags join its groups
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument("--num-warmups", type=int, default=0,
                      help="requests (copies of the first one) sent before the run and not counted")
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    load.add_argument("--request-timeout", type=float, default=600.0, help="deadline of each request (s)")
    load.add_argument("--ready-timeout", type=float, default=30.0,
                      help="how long to wait for the target to answer GetModelInfo / GET /v1/models (s)")
    out.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def add_workload_args(p: argparse.ArgumentParser) -> tuple[Any, Any, Any]:
    """The workload, load and output flags ``pdserve bench`` and ``pdserve simulate`` share (vLLM's names);
    returns their three argument groups ("workload", "load", "output") for command-specific flags."""
    src = p.add_argument_group("workload")
    src.add_argument("--dataset-name", choices=("random", "trace"), default=None,
                     help="random lengths, or a trace replay (default: trace when --trace is given, else random)")
    src.add_argument("--trace", "--dataset-path", dest="trace",
                     help="trace to replay: a CSV (TIMESTAMP, ContextTokens, GeneratedTokens), Mooncake JSON lines, or "
                          "a packaged sample: sample:conversation, sample:code (1,000 rows each of the Azure LLM "
                          "inference trace 2023)")
    src.add_argument("--trace-start", type=int, default=0, help="first trace row to replay (0-based)")
    src.add_argument("--length-scale", type=float, default=1.0, help="multiply trace prompt/output lengths")
    src.add_argument("--time-scale", type=float, default=1.0,
                     help="multiply trace inter-arrival times (<1 = faster)")
    src.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128,
                     help="random prompt length (after the prefix)")
    src.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=32,
                     help="random output length")
    src.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                     help="random lengths uniform in [L*(1-r), L*(1+r)]")
    src.add_argument("--random-prefix-len", type=int, default=0,
                     help="tokens of one shared random prefix before every prompt (vLLM's meaning: a prompt is "
                          "prefix + its random input)")
    src.add_argument("--num-prompts", type=int, default=100, help="requests to send (trace rows to replay)")
    src.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=None,
                      help="mean req/s (default: inf, or the trace's own timing with --trace)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier")
    load.add_argument("--ramp-up-strategy", choices=RAMP_UP_STRATEGIES, default=None,
                      help="rate moves from --ramp-up-start-rps to --ramp-up-end-rps over the run "
                           "(instead of --request-rate)")
    load.add_argument("--ramp-up-start-rps", type=float, default=None, help="ramp-up: rate of the first request")
    load.add_argument("--ramp-up-end-rps", type=float, default=None, help="ramp-up: rate of the last request")
    load.add_argument("--ignore-eos", action="store_true",
                      help="accepted for vLLM command lines; always on (outputs are forced to their length)")
    out = p.add_argument_group("output")
    out.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 (e2el too)")
    out.add_argument("--metric-percentiles", "--percentiles", dest="percentiles", default="99",
                     help="comma-separated percentiles to report, e.g. 50,90,99 (default 99)")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                     help="comma-separated metrics whose mean/median/std/percentiles are reported "
                          "(of ttft,tpot,itl,e2el; default all four)")
    out.add_argument("--label", default=None,
                     help="label of the run: in the table, the JSON and the default file name (default: backend)")
    out.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", default=None,
                     help="extra KEY=VALUE pairs written into the result JSON")
    out.add_argument("--save-result", nargs="?", const=True, default=None, metavar="FILE.json",
                     help="write the result JSON: to FILE.json, or bare (as vLLM) to --result-dir under vLLM's "
                          "name {label}-{rate}qps[-concurrencyN]-{model}-{date}.json")
    out.add_argument("--result-dir", default=None, metavar="DIR",
                     help="folder of the result JSON (with --save-result; default: the current folder)")
    out.add_argument("--result-filename", default=None, metavar="NAME",
                     help="file name of the result JSON in --result-dir (with --save-result)")
    return src, load, out


def parse_metadata(items: Optional[list[str]]) -> dict[str, str]:
    """["a=1", "b=x"] -> {"a": "1", "b": "x"}; ValueError naming --metadata otherwise."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--metadata: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


def parse_percentiles(text: str) -> list[float]:
    try:
        percentiles = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles (percentiles) must be comma-separated numbers, got {text!r}") from None
    if not percentiles or not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles (percentiles) must be within [0, 100], got {text!r}")
    return percentiles


def check_args(args: argparse.Namespace) -> None:
    """Checks that need no server; ValueError naming the flag."""
    if args.backend == "grpc":
        check_target(args.target)
        if args.base_url is not None:
            raise ValueError("--base-url is for --backend openai (gRPC uses --target)")
    else:
        if args.base_url is None:
            raise ValueError("--backend openai needs --base-url http://HOST:PORT")
        args.base_url = check_base_url(args.base_url)
        if args.vocab_size is None and args.tokenizer is None:
            raise ValueError("--backend openai needs --tokenizer PATH or --vocab-size N "
                             "(random prompts are token ids; the HTTP API does not report the vocabulary)")
        if args.vocab_size is not None and args.vocab_size < 1:
            raise ValueError(f"--vocab-size must be >= 1, got {args.vocab_size}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {args.max_concurrency}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    check_workload_args(args)


def check_workload_args(args: argparse.Namespace) -> None:
    """Checks of ``add_workload_args``' flags; ValueError naming the flag. Sets ``dataset_name`` when
    left to its default and the parsed ``percentile_list``, ``percentile_metric_list``, ``metadata_dict``, ``slos``."""
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {args.num_prompts}")
    if args.random_prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {args.random_prefix_len}")
    if args.dataset_name is None:
        args.dataset_name = "trace" if args.trace else "random"
    if args.dataset_name == "trace" and not args.trace:
        raise ValueError("--dataset-name trace needs --trace FILE (or --dataset-path FILE)")
    if args.dataset_name == "random" and args.trace:
        raise ValueError("--trace is for --dataset-name trace")
    if args.random_prefix_len and args.dataset_name != "random":
        raise ValueError("--random-prefix-len is for --dataset-name random")
    if args.ramp_up_strategy is not None:
        if args.request_rate is not None:
            raise ValueError("--ramp-up-strategy sets the rate: do not give --request-rate with it")
        check_ramp_up(args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps)
    elif args.ramp_up_start_rps is not None or args.ramp_up_end_rps is not None:
        raise ValueError("--ramp-up-start-rps/--ramp-up-end-rps need --ramp-up-strategy linear|exponential")
    if (args.result_dir or args.result_filename) and not args.save_result:
        raise ValueError("--result-dir/--result-filename need --save-result")
    args.percentile_list = parse_percentiles(args.percentiles)
    args.percentile_metric_list = parse_percentile_metrics(args.percentile_metrics)
    args.metadata_dict = parse_metadata(args.metadata)
    args.slos = parse_goodput(args.goodput)


def tokenizer_vocab_size(path: str) -> int:
    """Tokens in ``path`` (a tokenizer.json or a folder with one), added tokens included."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"--tokenizer: no tokenizer.json at {str(p)!r}")
    try:
        return Tokenizer.from_file(str(p)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # the library's own error types
        raise ValueError(f"--tokenizer: cannot load {str(p)!r}: {e}") from None


def result_path(args: argparse.Namespace, settings: dict) -> Path:
    """Where --save-result writes: FILE as given, else --result-filename or vLLM's name, in --result-dir."""
    name = args.save_result if isinstance(args.save_result, str) else (
        args.result_filename or default_result_name(settings))
    path = Path(name)
    if args.result_dir and not path.is_absolute():
        path = Path(args.result_dir) / path
    return path


def _settings(args: argparse.Namespace, model_name: str, mode: str, request_rate: Optional[float], num_sent: int,
              num_clipped: int) -> dict:
    s = {"backend": BACKEND_NAMES[args.backend], "endpoint_type": BACKEND_NAMES[args.backend],
         "label": args.label or BACKEND_NAMES[args.backend], "model_id": model_name, "mode": mode,
         "num_prompts": num_sent, "request_rate": request_rate if request_rate is not None else "trace",
         "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
         "temperature": args.temperature, "num_warmups": args.num_warmups,
         "percentile_metrics": ",".join(args.percentile_metric_list),
         "metric_percentiles": ",".join(f"{p:g}" for p in args.percentile_list),
         "num_clipped_to_model_limits": num_clipped}
    if args.lora_modules:
        s["lora_modules"] = list(args.lora_modules)
    if args.backend == "grpc":
        s["target"] = args.target
    else:
        s.update(base_url=args.base_url, endpoint="/v1/completions", tokenizer_id=args.tokenizer)
    s.update(workload_settings(args, s["request_rate"]))
    s["metadata"] = args.metadata_dict  # report.result_dict writes the pairs as top-level keys
    return s


def workload_settings(args: argparse.Namespace, request_rate: object) -> dict:
    """The result JSON's keys that describe ``add_workload_args``' workload (``pdserve bench`` and ``simulate``)."""
    s: dict = {"request_rate": request_rate}
    if args.ramp_up_strategy:
        s.update(request_rate="ramp-up", ramp_up_strategy=args.ramp_up_strategy,
                 ramp_up_start_rps=args.ramp_up_start_rps, ramp_up_end_rps=args.ramp_up_end_rps)
    if args.dataset_name == "trace":
        s.update(dataset="trace", dataset_name="trace", trace=args.trace, trace_start=args.trace_start,
                 length_scale=args.length_scale, time_scale=args.time_scale)
    else:
        s.update(dataset="random", dataset_name="random", input_len=args.input_len, output_len=args.output_len,
                 range_ratio=args.range_ratio, random_prefix_len=args.random_prefix_len)
    if isinstance(s["request_rate"], float) and math.isinf(s["request_rate"]):
        s["request_rate"] = "inf"  # JSON has no Infinity
    return s


def workload_lengths_and_arrivals(args: argparse.Namespace) -> tuple[Optional[float], list[tuple[int, int]],
                                                                       list[float]]:
    """(request rate as reported, (prompt, output) lengths, send offsets) of the flags' workload: trace rows
    scaled by --length-scale / --time-scale, or random lengths; arrivals from the trace, Poisson/gamma at
    --request-rate, or a ramp-up. ValueError on a bad trace (naming the file and row)."""
    request_rate = args.request_rate
    if args.dataset_name == "trace":
        rows = scale_trace(load_trace(args.trace, args.trace_start, args.num_prompts),
                           args.length_scale, args.time_scale)
        lengths = trace_lengths(rows)
        arrivals = (trace_arrivals([r.arrival_s for r in rows]) if request_rate is None
                    else gamma_arrivals(len(rows), request_rate, args.burstiness, args.seed))
    else:
        lengths = synthetic_lengths(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
        request_rate = math.inf if request_rate is None else request_rate
        arrivals = gamma_arrivals(len(lengths), request_rate, args.burstiness, args.seed)
    if args.ramp_up_strategy:
        arrivals = ramp_up_arrivals(len(lengths), args.ramp_up_strategy, args.ramp_up_start_rps,
                                    args.ramp_up_end_rps, args.burstiness, args.seed)
    return request_rate, lengths, arrivals


async def _target_info(args: argparse.Namespace) -> tuple[str, str, ModelLimits]:
    """(model name, serving mode, limits) of the target; ConnectionError when it never answered."""
    if args.backend == "grpc":
        try:
            info = await fetch_model_info(args.target, timeout_s=args.ready_timeout, auth=args.auth)
        except grpc.aio.AioRpcError as e:
            raise ConnectionError(f"{e.code().name}: {e.details()}") from None
        return info.model_name, info.mode, limits_from_info(info)
    vocab = args.vocab_size if args.vocab_size is not None else tokenizer_vocab_size(args.tokenizer)
    name, max_len = await fetch_openai_info(args.base_url, timeout_s=args.ready_timeout, auth=args.auth)
    return args.model or name, "", ModelLimits(vocab_size=vocab, max_context_length=max_len)


async def _run(args: argparse.Namespace, cfg: ClientConfig, model: str, requests: list[BenchRequest],
               on_done=None):
    if args.backend == "grpc":
        return await run_benchmark(cfg, requests, on_done=on_done)
    return await run_openai_benchmark(cfg, args.base_url, model, requests, on_done=on_done,
                                      embeddings=args.backend == "openai-embeddings")


async def _bench(args: argparse.Namespace) -> int:
    try:
        model_name, mode, limits = await _target_info(args)
    except ConnectionError as e:
        where = args.target if args.backend == "grpc" else args.base_url
        print(f"error: target {where} unreachable: {e}", file=sys.stderr)
        return 2

    request_rate, lengths, arrivals = workload_lengths_and_arrivals(args)
    # A unique prefix keeps request ids (and so server logs) of concurrent benches apart.
    id_prefix = f"bench-{uuid.uuid4().hex[:8]}"
    workload = build_workload(lengths, arrivals, limits, seed=args.seed, id_prefix=id_prefix,
                              prefix_len=args.random_prefix_len)
    if args.lora_modules:
        counts = assign_models(workload.requests, list(args.lora_modules), args.seed)
        print("LoRA adapters, requests each: " + ", ".join(f"{m} {n}" for m, n in counts.items()))
    if workload.num_clipped:
        log.warning("%d of %d requests clipped to the model's limits (context %d, prompt %d, new %d)",
                    workload.num_clipped, len(lengths), limits.max_context_length, limits.max_prompt_tokens,
                    limits.max_new_tokens)
    cfg = ClientConfig(target=args.target, temperature=args.temperature,
                       max_concurrency=args.max_concurrency, request_timeout_s=args.request_timeout,
                       auth=args.auth, pdserve_timings=args.pdserve_timings)

    if args.num_warmups:
        # vLLM's warm-up: copies of the first request, at once (under the cap), before the clock starts.
        first = workload.requests[0]
        warm = [BenchRequest(f"{id_prefix}-warmup-{i}", first.prompt_token_ids, first.max_tokens, 0.0, first.model)
                for i in range(args.num_warmups)]
        warm_records, _ = await _run(args, cfg, model_name, warm)
        failed = [r for r in warm_records if not r.success]
        print(f"warm-up: {len(warm) - len(failed)} of {len(warm)} request(s) completed")
        if failed:
            log.warning("%d warm-up request(s) failed, e.g. %s", len(failed), failed[0].error)

    with tqdm(total=len(workload.requests), disable=args.disable_tqdm, desc="bench", unit="req") as bar:
        records, duration = await _run(args, cfg, model_name, workload.requests, on_done=lambda _r: bar.update(1))

    settings = _settings(args, model_name, mode, request_rate, len(workload.requests), workload.num_clipped)
    summary = summarize(records, duration, args.percentile_list, args.slos or None, args.percentile_metric_list)
    print_summary(summary, settings)
    if args.save_result:
        path = save_result(result_path(args, settings), summary, settings, records)
        print(f"result saved to {path}")
    if args.plot:
        if args.dataset_name == "trace":
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
        check_args(args)
        args.auth = client_auth_from_args(args)
        if args.backend == "grpc":
            args.auth.credentials()  # an unreadable --ssl-* file is bad input (exit 2), found before any call
        elif args.base_url.startswith("https://"):
            args.auth.ssl_context()
        return asyncio.run(_bench(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # asyncio.run has cancelled every in-flight call by now
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
