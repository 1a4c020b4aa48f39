"""Disaggregated (1 prefill + 1 decode worker) against colocated (1 worker) serving, same load, one run.

Lifecycle: for each mode the script serves a TCPStore on a free port (the KV
rendezvous), spawns the mode's workers as separate processes (real engines,
real gRPC, gloo KV transfer between prefill and decode), starts a router in this
process reading the workers' live load over GetInfo, and replays the same
synthetic load with ``pdserve bench`` (``loadtest.cli``) against it; then it
stops everything and prints both result tables side by side (ratios, not
absolute numbers, are the point: disaggregation keeps long prefills from
stalling decode steps, which shows in ITL/TPOT tails).

Usage: python benchmarks/disagg_vs_colocated.py [--model tiny] [--num-prompts 48] [--input-len 384]
       [--output-len 48] [--request-rate 6] [--seed 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
from pathlib import Path
from typing import Any

KEYS = ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms")


def _worker(role: str, worker_id: str, model: str, kv_store: str, q: Any, stop: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from engine.config import EngineConfig

    eng = EngineConfig(model=model, num_threads=1)
    if role == "prefill":
        from prefill_worker import PrefillWorker, PrefillWorkerConfig
        w = PrefillWorker(PrefillWorkerConfig(worker_id, engine=eng, kv_store=kv_store, serve_metrics=False))
    elif role == "decode":
        from decode_worker import DecodeWorker, DecodeWorkerConfig
        w = DecodeWorker(DecodeWorkerConfig(worker_id, engine=eng, kv_store=kv_store, serve_metrics=False))
    else:
        from decode_worker import ColocatedWorker, ColocatedWorkerConfig
        w = ColocatedWorker(ColocatedWorkerConfig(worker_id, engine=eng, serve_metrics=False))
    w.start()
    q.put((role, w.address))
    stop.wait(3600)
    w.stop()


def run_mode(mode: str, ns: argparse.Namespace) -> dict:
    import grpc
    import torch

    from loadtest.cli import main as bench_main
    from proto import worker_pb2, worker_pb2_grpc
    from router import RouterConfig, RouterServer, StaticWorkerSource

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    url = f"tcp://127.0.0.1:{store.port}"
    ctx = mp.get_context("spawn")
    roles = ["prefill", "decode"] if mode == "disaggregated" else ["colocated"]
    procs, stops, q = [], [], ctx.Queue()
    stubs = {"prefill": worker_pb2_grpc.PrefillWorkerStub, "decode": worker_pb2_grpc.DecodeWorkerStub,
             "colocated": worker_pb2_grpc.ColocatedWorkerStub}
    channels, router = [], None
    try:
        for i, role in enumerate(roles):
            stop = ctx.Event()
            p = ctx.Process(target=_worker, args=(role, f"bench-{role}{i}", ns.model, url, q, stop), daemon=True)
            p.start()
            procs.append(p)
            stops.append(stop)
        infos = []
        for _ in roles:
            role, addr = q.get(timeout=300)
            ch = grpc.insecure_channel(addr)
            channels.append(ch)
            stub = stubs[role](ch)
            infos.append(lambda stub=stub: stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5))
        router = RouterServer(RouterConfig(model=ns.model, mode=mode, serve_metrics=False),
                              StaticWorkerSource(infos)).start()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            rc = bench_main(["--target", router.address, "--num-prompts", str(ns.num_prompts),
                             "--input-len", str(ns.input_len), "--output-len", str(ns.output_len),
                             "--range-ratio", "0.25", "--request-rate", str(ns.request_rate),
                             "--seed", str(ns.seed), "--disable-tqdm", "--save-result", str(out)])
            if rc != 0:
                raise RuntimeError(f"{mode}: pdserve bench exited with {rc}")
            return json.loads(out.read_text())
    finally:
        if router is not None:
            router.stop()
        for ch in channels:
            ch.close()
        for stop in stops:
            stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=384)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--request-rate", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="write both results here")
    ns = ap.parse_args(argv)
    results = {mode: run_mode(mode, ns) for mode in ("disaggregated", "colocated")}

    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{ns.model}: {ns.num_prompts} requests, ~{ns.input_len} in / {ns.output_len} out, "
                    f"{ns.request_rate} req/s")
    t.add_column("metric")
    t.add_column("disaggregated", justify="right")
    t.add_column("colocated", justify="right")
    t.add_column("dis / colo", justify="right")
    for k in KEYS:
        a, b = results["disaggregated"].get(k), results["colocated"].get(k)
        if a is None or b is None:
            continue
        t.add_row(k, f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}" if b else "-")
    Console().print(t)
    if ns.json is not None:
        ns.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
