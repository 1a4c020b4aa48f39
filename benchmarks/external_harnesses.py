"""The load generators users bring, unchanged, against `pdserve up`'s OpenAI endpoint (issue 48, part 3).

People who evaluate a serving system run their own harness, not the system's. This script runs three of them,
each installed from the package registry into a virtual environment of its own and run as its authors ship it
(their own CLI, no patch), against one `pdserve up` cluster's HTTP API, and compares what each reports with
`pdserve bench --backend openai` on the same workload in the same run:

| tool | version | how it is run |
| --- | --- | --- |
| NVIDIA AIPerf | 0.13.0 | ``aiperf profile --endpoint-type completions --streaming`` (synthetic prompts); and ``--fixed-schedule`` replay of a Mooncake-format JSONL trace (``--custom-dataset-type mooncake_trace``) |
| guidellm | 0.8.1 | ``guidellm run --backend kind=openai_http,request_format=/v1/completions --data kind=synthetic_text`` |
| SGLang ``bench_serving`` | 0.5.5 | ``python -m sglang.bench_serving --backend vllm --dataset-name random-ids`` |

Why SGLang 0.5.5: from 0.5.6 on, ``sglang.bench_serving`` imports the SGLang runtime (``sglang.srt``: triton,
tvm-ffi, CUDA builds of torch and torchvision) before it parses its arguments, which a CPU host cannot import;
0.5.5's is the newest that runs with the client's own dependencies. It is installed ``--no-deps`` with those
(``SGLANG_DEPS``): the full ``sglang`` package pulls gigabytes of CUDA wheels. guidellm requires torch: the
CPU wheel (``torch==2.13.0``) is installed first so pip does not fetch a CUDA build.

Workload (the same for every tool): ``--num-prompts`` requests of ``--input-len`` prompt tokens and exactly
``--output-len`` output tokens (each tool sends ``max_tokens`` and vLLM's ``ignore_eos``), a closed loop of
``--concurrency`` requests in flight, greedy. pdserve bench sends random token ids; the others send text made
to be ``--input-len`` tokens under the model's tokenizer (``engine/assets/tokenizer`` for ``tiny``), so the
server sees the same lengths (plus the BOS token a text prompt gets). Each repetition runs pdserve bench first,
then each tool, on the same cluster.

Trace replay: a Mooncake-format JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``) is replayed on
its own clock by AIPerf (``--fixed-schedule``) and by ``pdserve bench --trace``; by default the first
``--trace-rows`` rows of the packaged Azure conversation sample (loadtest/traces/, CC-BY 4.0), lengths x
``--trace-length-scale``, arrival gaps x ``--trace-time-scale``, written as Mooncake JSON lines.

Printed: per tool, requests completed and failed, TTFT mean / median / p90, TPOT mean (vLLM's: (E2EL - TTFT) /
(output tokens - 1) per request; guidellm's ``inter_token_latency``, AIPerf's ``inter_token_latency``), output
tokens per second, and each against pdserve bench's. Output tokens: AIPerf is told to use the server's counts
(``--use-server-token-count``); guidellm reads the stream's usage; SGLang's client re-tokenizes the text (its
way), which can differ from the forced length by a token or two.

Usage (a `pdserve up` of its own on free ports, 1 prefill + 1 decode ``tiny`` workers):
    python benchmarks/external_harnesses.py --repeat 2 --json results/harnesses.json
against a running cluster: ``--base-url http://HOST:PORT``, one without an API key: AIPerf and guidellm take a key
only on their command lines (visible in ``ps``), so the script passes none and refuses to run them while
``PDSERVE_API_KEY`` is set (pdserve bench alone, ``--tools ""``, reads it from the environment).
Environments go to ``--env-dir`` (default ``.harness-envs/`` beside the repository's ``.venv``; git-ignored);
``--install-only`` prepares them and exits.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "engine" / "assets" / "tokenizer"
AZURE_CONV_SAMPLE = REPO / "loadtest" / "traces" / "azure_llm_2023_conv_sample.csv"

SGLANG_DEPS = ["aiohttp", "numpy", "pybase64", "requests", "tqdm", "transformers", "datasets", "pillow",
               "setproctitle", "IPython"]


@dataclass
class Tool:
    """One harness: what to install in its environment and its console command."""

    name: str
    steps: list[list[str]]  # pip install argument lists, in order
    probe: list[str]  # run in the environment to check it works (a --help or --version)

    def spec(self) -> str:
        return json.dumps(self.steps)


TOOLS: dict[str, Tool] = {
    "aiperf": Tool("aiperf", [["aiperf==0.13.0"]], ["bin/aiperf", "--version"]),
    "guidellm": Tool("guidellm", [["torch==2.13.0"], ["guidellm==0.8.1"]], ["bin/guidellm", "--version"]),
    "sglang": Tool("sglang", [["--no-deps", "sglang==0.5.5"], SGLANG_DEPS],
                   ["bin/python", "-m", "sglang.bench_serving", "--help"]),
}


@dataclass
class Result:
    """What one tool reported, in pdserve bench's units (ms, tokens/s)."""

    tool: str
    completed: int
    failed: int
    ttft_mean: float
    ttft_median: float
    ttft_p90: Optional[float]
    tpot_mean: float
    output_tps: float
    wall_s: float
    client_cpu_s: float = 0.0
    server_prompt_tokens: Optional[float] = None  # per request, as the router counted them (with the warm-ups)
    raw: dict = field(default_factory=dict, repr=False)

    def row(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "raw"}


# ---- environments ---------------------------------------------------------------------------------------------
def ensure_env(tool: Tool, env_dir: Path, log: Callable[[str], None]) -> Path:
    """The tool's virtual environment, created and installed on first use (a stamp records what was installed)."""
    root = env_dir / tool.name
    stamp = root / ".pdserve-harness"
    if stamp.exists() and stamp.read_text() == tool.spec():
        return root
    if root.exists():
        shutil.rmtree(root)
    log(f"[{tool.name}] creating {root} and installing {tool.steps} (minutes, once)")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    for step in tool.steps:
        subprocess.run([str(root / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", *step], check=True)
    probe = subprocess.run([str(root / tool.probe[0]), *tool.probe[1:]], capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError(f"{tool.name}: installed, but {' '.join(tool.probe)} fails:\n{probe.stderr[-2000:]}")
    stamp.write_text(tool.spec())
    return root


# ---- the cluster ----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A `pdserve up` on free ports, ready once its banner names the HTTP API; stopped with SIGINT."""

    def __init__(self, args: list[str], ready_timeout_s: float, cpus: Optional[set[int]] = None) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))  # Ray's processes inherit it
        cmd = [sys.executable, "-m", "cluster.cli", "up", "--port", "0", "--http-port", str(free_port()), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True, preexec_fn=pin)
        self.lines: list[str] = []
        self.base_url = ""
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                m = re.match(r"\s+http\s+(http://\S+)/v1", line)
                if m:
                    self.base_url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(ready_timeout_s) or not self.base_url:
            self.stop()
            raise RuntimeError("pdserve up did not serve:\n" + "\n".join(self.lines[-40:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


# ---- runs -----------------------------------------------------------------------------------------------------
CLIENT_CPUS: Optional[set[int]] = None
"""``--pin``: the CPUs every tool (and pdserve bench) runs on; the cluster runs on the others."""


def _run(cmd: list[str], log_path: Path, timeout_s: float, env: Optional[dict] = None) -> tuple[float, float]:
    """Run ``cmd`` with its output in ``log_path``: (wall s, CPU s it and its children used). A non-zero exit raises
    with the log's tail."""
    t0, r0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    pin = None if CLIENT_CPUS is None else (lambda: os.sched_setaffinity(0, CLIENT_CPUS))
    with open(log_path, "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=log_path.parent,
                            env=env, preexec_fn=pin).returncode
    if rc != 0:
        raise RuntimeError(f"{cmd[0]} exited {rc}:\n{log_path.read_text()[-3000:]}")
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic() - t0, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def server_counts(base_url: str) -> dict[str, float]:
    """The router's own counters at ``/metrics``: prompt and generation tokens, requests (every status)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    want = {"pdserve:prompt_tokens_total": "prompt_tokens", "pdserve:generation_tokens_total": "generation_tokens",
            "pdserve:e2e_request_latency_seconds_count": "requests"}
    got = dict.fromkeys(want.values(), 0.0)
    key = os.environ.get("PDSERVE_API_KEY")
    resp = httpx.get(f"{base_url}/metrics", timeout=30.0, headers={"Authorization": f"Bearer {key}"} if key else None)
    resp.raise_for_status()
    text = resp.text
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name in want:
                got[want[smp.name]] += smp.value
    return got


def _pct(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default, as the tools compute theirs)."""
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def run_pdserve(base_url: str, w: argparse.Namespace, out: Path, trace: Optional[Path] = None) -> Result:
    res = out / "pdserve.json"
    cmd = [sys.executable, "-m", "loadtest.cli", "--backend", "openai", "--base-url", base_url,
           "--tokenizer", str(TOKENIZER), "--metric-percentiles", "50,90,99", "--disable-tqdm",
           "--save-result", str(res)]
    if trace is None:
        cmd += ["--dataset-name", "random", "--random-input-len", str(w.input_len), "--random-output-len",
                str(w.output_len), "--random-range-ratio", "0", "--num-prompts", str(w.num_prompts),
                "--max-concurrency", str(w.concurrency), "--seed", str(w.seed), "--num-warmups", str(w.warmups)]
    else:
        cmd += ["--trace", str(trace), "--num-prompts", str(w.trace_rows)]
    wall, cpu = _run(cmd, out / "pdserve.log", w.run_timeout_s, env=dict(os.environ, PYTHONPATH=str(REPO)))
    d = json.loads(res.read_text())
    return Result("pdserve bench", d["completed"], d["failed"], d["mean_ttft_ms"], d["median_ttft_ms"],
                  d.get("p90_ttft_ms"), d["mean_tpot_ms"], d["output_throughput"], wall, cpu, d)


def run_aiperf(env: Path, base_url: str, w: argparse.Namespace, out: Path, trace: Optional[Path] = None) -> Result:
    art = out / "aiperf"
    cmd = [str(env / "bin" / "aiperf"), "profile", "--model", w.model, "--url", base_url,
           "--endpoint-type", "completions", "--streaming", "--tokenizer", str(TOKENIZER),
           "--use-server-token-count", "--extra-inputs", "ignore_eos:true", "--random-seed", str(w.seed),
           "--output-artifact-dir", str(art), "--ui-type", "none"]
    if trace is None:
        cmd += ["--synthetic-input-tokens-mean", str(w.input_len), "--synthetic-input-tokens-stddev", "0",
                "--output-tokens-mean", str(w.output_len), "--output-tokens-stddev", "0",
                "--concurrency", str(w.concurrency), "--request-count", str(w.num_prompts),
                "--warmup-request-count", str(w.warmups)]
    else:
        cmd += ["--input-file", str(trace), "--custom-dataset-type", "mooncake_trace", "--fixed-schedule"]
    wall, cpu = _run(cmd, out / "aiperf.log", w.run_timeout_s)
    found = sorted(art.rglob("profile_export_aiperf.json"))
    if not found:
        raise RuntimeError(f"aiperf wrote no profile_export_aiperf.json under {art}")
    d = json.loads(found[-1].read_text())

    def m(name: str, stat: str) -> float:
        v = d.get(name)
        if isinstance(v, dict) and stat in v:
            return float(v[stat])
        return float("nan")

    completed = int(m("completed_request_count" if "completed_request_count" in d else "request_count", "avg"))
    failed = sum(int(e.get("count", 1)) for e in d.get("error_summary") or [])
    return Result("aiperf", completed, failed, m("time_to_first_token", "avg"), m("time_to_first_token", "p50"),
                  m("time_to_first_token", "p90"), m("inter_token_latency", "avg"),
                  m("output_token_throughput", "avg"), wall, cpu, d)


def run_guidellm(env: Path, base_url: str, w: argparse.Namespace, out: Path) -> Result:
    res = out / "guidellm.json"
    cmd = [str(env / "bin" / "guidellm"), "run",
           "--backend", f"kind=openai_http,target={base_url},model={w.model},request_format=/v1/completions",
           "--profile", f"kind=concurrent,streams={w.concurrency}",
           "--constraint", f"kind=max_requests,count={w.num_prompts}",
           "--data", f"kind=synthetic_text,prompt_tokens={w.input_len},output_tokens={w.output_len}",
           "--tokenizer", f"kind=hf_auto,model={TOKENIZER}",
           "--seed", f"kind=static,value={w.seed}",
           "--output", f"kind=json,path={res}", "--disable-console-interactive"]
    wall, cpu = _run(cmd, out / "guidellm.log", w.run_timeout_s)
    d = json.loads(res.read_text())
    b = d["benchmarks"][0]
    mt = b["metrics"]

    def m(name: str, stat: str) -> float:
        s = mt[name]["successful"]
        return float(s[stat]) if stat in s else float(s["percentiles"][stat])

    totals = mt.get("request_totals") or b.get("request_totals") or {}
    return Result("guidellm", int(totals.get("successful", 0)), int(totals.get("errored", 0)),
                  m("time_to_first_token_ms", "mean"), m("time_to_first_token_ms", "median"),
                  m("time_to_first_token_ms", "p90"), m("inter_token_latency_ms", "mean"),
                  m("output_tokens_per_second", "mean"), wall, cpu)


def run_sglang(env: Path, base_url: str, w: argparse.Namespace, out: Path) -> Result:
    res = out / "sglang.jsonl"
    cmd = [str(env / "bin" / "python"), "-m", "sglang.bench_serving", "--backend", "vllm", "--base-url", base_url,
           "--model", w.model, "--tokenizer", str(TOKENIZER), "--dataset-name", "random-ids",
           "--random-input-len", str(w.sglang_input_len or w.input_len), "--random-output-len", str(w.output_len),
           "--random-range-ratio", "1.0", "--num-prompts", str(w.num_prompts), "--max-concurrency",
           str(w.concurrency), "--request-rate", "inf", "--seed", str(w.seed), "--output-file", str(res),
           "--warmup-requests", str(w.warmups), "--output-details", "--disable-tqdm"]
    wall, cpu = _run(cmd, out / "sglang.log", w.run_timeout_s)
    d = json.loads(res.read_text().strip().splitlines()[-1])
    ttfts = [t * 1000.0 for t in d.get("ttfts", [])]
    return Result("sglang bench_serving", int(d["completed"]), w.num_prompts - int(d["completed"]),
                  float(d["mean_ttft_ms"]), float(d["median_ttft_ms"]), _pct(ttfts, 90) if ttfts else None,
                  float(d["mean_tpot_ms"]), float(d["output_throughput"]), wall, cpu)


# ---- the trace ------------------------------------------------------------------------------------------------
def write_mooncake_trace(path: Path, rows: int, length_scale: float, time_scale: float, max_len: int,
                         source: Path = AZURE_CONV_SAMPLE) -> Path:
    """The first ``rows`` rows of ``source`` (a trace ``loadtest.trace`` reads; default the packaged Azure conversation
    sample) as Mooncake JSON lines: ``timestamp`` in ms from 0, lengths x ``length_scale`` (``scale_trace``'s
    rounding), gaps x ``time_scale``, each prompt cut so prompt + output fit ``max_len`` with a token to spare."""
    from loadtest.trace import load_trace, scale_trace

    with open(path, "w") as f:
        for r in scale_trace(load_trace(source, 0, rows), length_scale, time_scale):
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000.0), "output_length": r.output_len,
                                "input_length": max(1, min(r.prompt_len, max_len - r.output_len - 1))}) + "\n")
    return path


# ---- report ---------------------------------------------------------------------------------------------------
def _ratio(a: Optional[float], b: Optional[float]) -> str:
    if a is None or b is None or not b or a != a or b != b:
        return "-"
    return f"{a / b:.2f}x"


def _num(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f}"


def report(title: str, results: list[Result], ref: Result) -> list[str]:
    lines = [title, f"{'tool':22} {'ok':>4} {'err':>4} {'TTFT mean':>10} {'median':>8} {'p90':>8} "
                    f"{'TPOT mean':>10} {'out tok/s':>10} {'client CPU s':>12} {'server ISL':>10}   "
                    f"vs pdserve bench: TTFT mean / median, TPOT, tok/s"]
    for r in results:
        p90 = "-" if r.ttft_p90 is None else f"{r.ttft_p90:.1f}"
        isl = _num(r.server_prompt_tokens)
        lines.append(f"{r.tool:22} {r.completed:4d} {r.failed:4d} {r.ttft_mean:10.1f} {r.ttft_median:8.1f} {p90:>8} "
                     f"{r.tpot_mean:10.2f} {r.output_tps:10.1f} {r.client_cpu_s:12.1f} {isl:>10}   "
                     f"{_ratio(r.ttft_mean, ref.ttft_mean)} / "
                     f"{_ratio(r.ttft_median, ref.ttft_median)}, {_ratio(r.tpot_mean, ref.tpot_mean)}, "
                     f"{_ratio(r.output_tps, ref.output_tps)}")
    return lines


def counted(base_url: str, run: Callable[[], Result]) -> Result:
    """``run()``, with the prompt tokens per request the server counted meanwhile (what a text prompt became)."""
    before = server_counts(base_url)
    r = run()
    after = server_counts(base_url)
    n = after["requests"] - before["requests"]
    r.server_prompt_tokens = (after["prompt_tokens"] - before["prompt_tokens"]) / n if n else None
    return r


def mean_result(tool: str, rs: list[Result]) -> Result:
    def avg(xs: list[Optional[float]]) -> Optional[float]:
        xs = [x for x in xs if x is not None and x == x]
        return statistics.fmean(xs) if xs else None

    return Result(tool, sum(r.completed for r in rs), sum(r.failed for r in rs), avg([r.ttft_mean for r in rs]),
                  avg([r.ttft_median for r in rs]), avg([r.ttft_p90 for r in rs]), avg([r.tpot_mean for r in rs]),
                  avg([r.output_tps for r in rs]), sum(r.wall_s for r in rs), avg([r.client_cpu_s for r in rs]),
                  avg([r.server_prompt_tokens for r in rs]))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--tools", default="aiperf,guidellm,sglang", help="comma-separated subset of " + ",".join(TOOLS))
    ap.add_argument("--env-dir", type=Path, default=REPO / ".harness-envs")
    ap.add_argument("--install-only", action="store_true")
    ap.add_argument("--base-url", default="", help="a running cluster's HTTP API (default: start a pdserve up)")
    ap.add_argument("--up-args", default="--prefill 1 --decode 1", help="arguments of the pdserve up it starts")
    ap.add_argument("--model", default="tiny", help="the model id the server answers to (GET /v1/models)")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--sglang-input-len", type=int, default=0,
                    help="SGLang's --random-input-len (default --input-len): its random-ids prompts are token ids decoded "
                         "to text, which the server's tokenizer reads back longer (tiny: 256 ids -> ~281 tokens; 235 -> "
                         "~256); the server ISL column shows what each tool's prompts became")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmups", type=int, default=4, help="uncounted requests first (pdserve bench, AIPerf, SGLang; "
                                                             "guidellm has no such flag)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--trace", type=Path, default=None, help="a Mooncake JSONL trace (default: made from the sample)")
    ap.add_argument("--trace-rows", type=int, default=120)
    ap.add_argument("--trace-length-scale", type=float, default=0.25)
    ap.add_argument("--trace-time-scale", type=float, default=1.0)
    ap.add_argument("--no-trace", action="store_true", help="skip the fixed-schedule replay")
    ap.add_argument("--pin", action="store_true",
                    help="the cluster on all CPUs but the first, every client on the first: a client's own CPU (AIPerf "
                         "and guidellm run several processes) then cannot slow the server it measures")
    ap.add_argument("--run-timeout-s", type=float, default=900.0)
    ap.add_argument("--ready-timeout-s", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=None, help="folder for each run's logs and result files")
    ap.add_argument("--json", type=Path, default=None, help="write every result here")
    w = ap.parse_args(argv)
    names = [t for t in w.tools.split(",") if t]
    bad = [t for t in names if t not in TOOLS]
    if bad:
        ap.error(f"--tools: unknown {bad}; known: {sorted(TOOLS)}")
    for flag in ("num_prompts", "input_len", "output_len", "concurrency", "repeat", "trace_rows"):
        if getattr(w, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("warmups", "sglang_input_len"):
        if getattr(w, flag) < 0:
            ap.error(f"--{flag.replace('_', '-')} must be >= 0")
    if names and os.environ.get("PDSERVE_API_KEY"):
        ap.error("PDSERVE_API_KEY is set: the harnesses would need the key on their command lines; run them against "
                 "a cluster without a key (or --tools '' for pdserve bench alone)")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    envs = {t: ensure_env(TOOLS[t], w.env_dir, log) for t in names}
    if w.install_only:
        print("ready: " + ", ".join(f"{t} in {p}" for t, p in envs.items()))
        return 0
    out = w.out or Path(tempfile.mkdtemp(prefix="pdserve-harnesses-"))
    out.mkdir(parents=True, exist_ok=True)
    cluster = None
    server_cpus = None
    if w.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            ap.error("--pin needs at least 2 CPUs")
        global CLIENT_CPUS
        CLIENT_CPUS, server_cpus = {cpus[0]}, set(cpus[1:])
    if not w.base_url:
        log(f"starting pdserve up {w.up_args}" + (f" on CPUs {sorted(server_cpus)}" if server_cpus else ""))
        cluster = Cluster(w.up_args.split(), w.ready_timeout_s, server_cpus)
        w.base_url = cluster.base_url
    runners = {"aiperf": run_aiperf, "guidellm": run_guidellm, "sglang": run_sglang}
    runs: dict[str, list[Result]] = {"pdserve bench": []}
    trace_results: list[Result] = []
    lines: list[str] = []
    try:
        for rep in range(w.repeat):
            d = out / f"rep{rep}"
            d.mkdir(exist_ok=True)
            log(f"[{rep}] pdserve bench")
            runs["pdserve bench"].append(counted(w.base_url, lambda: run_pdserve(w.base_url, w, d)))
            for t in names:
                log(f"[{rep}] {t}")
                r = counted(w.base_url, lambda: runners[t](envs[t], w.base_url, w, d))
                runs.setdefault(r.tool, []).append(r)
        means = {k: mean_result(k, v) for k, v in runs.items()}
        ref = means["pdserve bench"]
        lines += report(f"closed loop: {w.num_prompts} requests x {w.repeat}, {w.input_len} -> {w.output_len} "
                        f"tokens, concurrency {w.concurrency}, against {w.base_url} (means over repetitions)",
                        list(means.values()), ref)
        if "aiperf" in names and not w.no_trace:
            d = out / "trace"
            d.mkdir(exist_ok=True)
            trace = w.trace or write_mooncake_trace(d / "mooncake.jsonl", w.trace_rows, w.trace_length_scale,
                                                    w.trace_time_scale, 2048)
            log(f"trace replay {trace}: pdserve bench, then aiperf --fixed-schedule")
            trace_results = [counted(w.base_url, lambda: run_pdserve(w.base_url, w, d, trace)),
                             counted(w.base_url, lambda: run_aiperf(envs["aiperf"], w.base_url, w, d, trace))]
            lines += [""] + report(f"fixed-schedule replay of {trace.name} ({w.trace_rows} rows)", trace_results,
                                   trace_results[0])
    finally:
        if cluster is not None:
            cluster.stop()
    print("\n".join(lines))
    if w.json:
        from loadtest.machine import machine_info

        w.json.parent.mkdir(parents=True, exist_ok=True)
        w.json.write_text(json.dumps({
            "argv": sys.argv[1:], "machine": machine_info(),
            "runs": {k: [r.row() for r in v] for k, v in runs.items()},
            "means": {k: mean_result(k, v).row() for k, v in runs.items()},
            "trace": [r.row() for r in trace_results]}, indent=1))
    failed = sum(r.failed for v in runs.values() for r in v) + sum(r.failed for r in trace_results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
