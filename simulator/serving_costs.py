"""Measuring the serving path for a profile: the KV link between two processes, and the router's costs.

Lifecycle: ``pdserve profile`` (simulator/profile.py) calls ``measure_link`` (kvtransfer's own endpoint over
gloo to a second process on loopback) and ``measure_router`` (a router in this process in front of a colocated
worker in its own pinned process, as a deployment runs them, this process pinned to another core meanwhile; then
of a prefill/decode pair in this process, on loopback gRPC) once each, after the engine's steps; each starts what it
needs and stops it before returning.
"""
from __future__ import annotations

import math
import os
import random
from concurrent.futures import ThreadPoolExecutor
import statistics
import time
from typing import Any, Callable, Optional, Sequence

# -- all-reduce among tensor-parallel ranks ------------------------------------------------------------

def _all_reduce_iters(rows: int) -> int:
    """Calls per timed repetition at ``rows`` rows (the same on every rank: they run in lockstep)."""
    return max(3, min(100, 8192 // rows))


def _all_reduce_rank(rank: int, port: int, size: int, width: int, rows: list[int], reps: int, threads: int,
                     dtype: str, master: Any = None) -> dict:
    import torch

    from engine.tensor_parallel import open_comm

    torch.set_num_threads(threads)
    comm = open_comm("127.0.0.1", port, rank, size, master=master)
    seconds = []
    for r in rows:
        x = torch.ones(r, width, dtype=getattr(torch, dtype))
        n = _all_reduce_iters(r)
        for _ in range(3):
            comm.all_reduce(x)
        per_call = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(n):
                comm.all_reduce(x)
            per_call.append((time.perf_counter() - t0) / n)
        seconds.append(statistics.median(per_call))
    return {"rows": rows, "seconds": seconds, "width": width, "dtype": dtype}


def measure_all_reduce(size: int, width: int, rows: Sequence[int], reps: int, threads: int,
                       dtype: str = "float32", timeout_s: float = 300.0) -> dict:
    """Seconds per ``TPComm.all_reduce`` (the engine's own collective) of [rows, width] among ``size`` ranks:
    this process and ``size - 1`` spawned ones on loopback, each timed in lockstep, the median of ``reps``
    repetitions per row count as rank 0 sees it. RuntimeError when a peer fails or outlives ``timeout_s``."""
    import multiprocessing as mp

    import torch.distributed as dist

    rows = list(rows)
    store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    peers = [ctx.Process(target=_all_reduce_rank, args=(r, store.port, size, width, rows, reps, threads, dtype),
                         daemon=True) for r in range(1, size)]
    for p in peers:
        p.start()
    try:
        out = _all_reduce_rank(0, store.port, size, width, rows, reps, threads, dtype, master=store)
        for p in peers:
            p.join(timeout_s)
            if p.exitcode != 0:
                raise RuntimeError(f"all-reduce rank {peers.index(p) + 1} ended with {p.exitcode}")
        return out
    finally:
        for p in peers:
            if p.is_alive():
                p.kill()
                p.join(5)


# -- KV link ---------------------------------------------------------------------------------------

def _link_cache(geom: tuple, num_blocks: int, fill: bool, device: str = "cpu") -> list:
    import torch

    if device != "cpu":  # the same contents on the GPU; the sender's as one CUDA IPC segment, as a prefill worker's
        host = _link_cache(geom, num_blocks, fill)
        if not fill:
            return [(k.to(device), v.to(device)) for k, v in host]
        from transport.cuda_ipc import CudaSegment

        each = -(-host[0][0].numel() * host[0][0].element_size() // 512) * 512
        seg = CudaSegment(2 * len(host) * each, device)
        out = []
        for i, (k, v) in enumerate(host):
            sk, sv = (seg.view((2 * i + j) * each, tuple(k.shape), k.dtype) for j in (0, 1))
            sk.copy_(k)
            sv.copy_(v)
            out.append((sk, sv))
        return out
    layers, bs, heads, width, dtype_name = geom
    dtype = getattr(torch, dtype_name)
    shape = (num_blocks, bs, heads, width)
    if fill:
        mk = (lambda: torch.randint(-100, 100, shape, dtype=dtype)) if dtype == torch.int8 else (
            lambda: torch.randn(shape).to(dtype))
    else:
        mk = lambda: torch.zeros(shape, dtype=dtype)  # noqa: E731
    cache = [(mk(), mk()) for _ in range(layers)]
    if fill:  # the sender's cache where a prefill worker's would be: in shared memory (its peers pull from it)
        from engine.kv_cache import share_kv_caches
        from transport.shared_memory import shared_memory_unavailable

        if shared_memory_unavailable() is None:
            cache = share_kv_caches(cache)
    return cache


def _link_receiver(conn: Any, store_port: int, geom: tuple, num_blocks: int, threads: int,
                   device: str = "cpu") -> None:
    """The second process: posts one receive per command and reports its end state."""
    import torch

    torch.set_num_threads(threads)
    from kvtransfer import KVEndpoint

    ep = KVEndpoint("profile-d", f"tcp://127.0.0.1:{store_port}", timeout_s=120.0, host="127.0.0.1",
                    backend="nccl" if device != "cpu" else "gloo")
    cache = _link_cache(geom, num_blocks, fill=False, device=device)
    conn.send("up")
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        _, rid, tokens = cmd
        h = ep.recv("profile-p", rid, cache, list(range(-(-tokens // geom[1]))), tokens)
        conn.send("ready")
        ep.wait(h, 120)
        conn.send(ep.poll(h).value)
    ep.shutdown()


def measure_link(geom: tuple, kv_bytes_per_token: int, sizes: Sequence[int], reps: int, threads: int,
                 device: str = "cpu") -> list[dict]:
    """Seconds from ``send()`` to DONE (the receiver's acknowledgement) for each size, median of ``reps``, and the
    path the bytes took (``TransferStats.link``: pull where this host lets the two processes share memory).
    ``device`` "cuda": both caches on this GPU and nccl endpoints, so the pair takes CUDA IPC (pull) where the two
    processes can map each other's memory, as a prefill and a decode worker sharing the GPU do."""
    import multiprocessing as mp

    import torch.distributed as dist

    from kvtransfer import KVEndpoint, TransferState

    bs = geom[1]
    token_counts = [max(1, round(s / kv_bytes_per_token)) for s in sizes]
    num_blocks = -(-max(token_counts) // bs)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_link_receiver, args=(child_conn, store.port, geom, num_blocks, threads, device),
                       daemon=True)
    proc.start()
    out = []
    ep = None
    try:
        deadline = time.monotonic() + 120
        while not conn.poll(0.05):
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"KV link: the receiving process did not start (exit code {proc.exitcode})")
        if conn.recv() != "up":
            raise RuntimeError("KV link: the receiving process did not start")
        ep = KVEndpoint("profile-p", store, timeout_s=120.0, host="127.0.0.1",
                        backend="nccl" if device != "cpu" else "gloo")
        cache = _link_cache(geom, num_blocks, fill=True, device=device)
        seq = iter(range(1 << 30))

        def once(tokens: int) -> tuple[float, int]:
            rid = f"link-{next(seq)}"
            conn.send(("recv", rid, tokens))
            if conn.recv() != "ready":
                raise RuntimeError("KV link: the receiver did not post its receive")
            t0 = time.perf_counter()
            h = ep.send("profile-d", rid, cache, list(range(-(-tokens // bs))), tokens, layers_ready=True)
            state = ep.wait(h, 120)
            dt = time.perf_counter() - t0
            if state != TransferState.DONE or conn.recv() != "done":
                raise RuntimeError(f"KV link: transfer {rid} failed: {ep.failure(h)}")
            st = ep.stats(h)
            return dt, st.num_bytes, st.link

        once(token_counts[0])  # the pair group's rendezvous and first connection
        for tokens in token_counts:
            ts = [once(tokens) for _ in range(reps + 1)][1:]
            out.append({"tokens": tokens, "bytes": ts[0][1], "seconds": statistics.median(t for t, _, _ in ts),
                        "reps_s": [t for t, _, _ in ts], "link": ts[0][2]})
        conn.send(("stop",))
    finally:
        if ep is not None:
            ep.shutdown()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return out


# -- router ----------------------------------------------------------------------------------------

def _worker_process(cfg: Any, cores: list[int], ready: Any, stop: Any) -> None:
    """The measured colocated worker in its own process, pinned to its own cores, as a deployment runs it."""
    os.sched_setaffinity(0, cores)
    import torch

    torch.set_num_threads(len(cores))
    from decode_worker import ColocatedWorker, ColocatedWorkerConfig

    try:
        w = ColocatedWorker(ColocatedWorkerConfig("profile-c0", engine=cfg, serve_metrics=False)).start()
    except BaseException as e:
        ready.put(("", f"{type(e).__name__}: {e}"))
        return
    ready.put((w.address, ""))
    try:
        stop.wait(24 * 3600)
    finally:
        w.stop()


class _WorkerApart:
    """A colocated worker in a pinned process, this process pinned to other cores while it lives (router and
    client), or, where the cores are too few, the worker in this process (``apart`` False)."""

    def __init__(self, cfg: Any, start_timeout_s: float = 300.0) -> None:
        from simulator.corun import cores_for

        self.cfg, self.timeout = cfg, start_timeout_s
        self.sets = cores_for(cfg.num_threads or 1, 1)
        self.apart = self.sets is not None
        self._before = os.sched_getaffinity(0)
        self._proc: Any = None
        self._worker: Any = None
        self._channel: Any = None

    def __enter__(self) -> Callable[[], Any]:
        """Returns the worker's ``info`` callable (a GetInfo RPC when apart); stops what it started if it fails."""
        try:
            return self._enter()
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _enter(self) -> Callable[[], Any]:
        if not self.apart:
            from decode_worker import ColocatedWorker, ColocatedWorkerConfig

            self._worker = ColocatedWorker(ColocatedWorkerConfig("profile-c0", engine=self.cfg,
                                                                 serve_metrics=False)).start()
            return self._worker.info
        import multiprocessing as mp

        import grpc

        from proto import worker_pb2, worker_pb2_grpc

        ctx = mp.get_context("spawn")
        self._stop, ready = ctx.Event(), ctx.Queue()
        self._proc = ctx.Process(target=_worker_process, args=(self.cfg, self.sets[1], ready, self._stop), daemon=True)
        self._proc.start()
        os.sched_setaffinity(0, self.sets[0])
        addr, err = ready.get(timeout=self.timeout)
        if err:
            raise RuntimeError(f"the profiled worker did not start: {err}")
        self._channel = grpc.insecure_channel(addr)
        stub = worker_pb2_grpc.ColocatedWorkerStub(self._channel)
        return lambda: stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)

    def __exit__(self, *exc: Any) -> None:
        if self._worker is not None:
            self._worker.stop()
        if self._proc is not None:
            self._stop.set()
            self._proc.join(30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
            os.sched_setaffinity(0, self._before)
        if self._channel is not None:
            self._channel.close()


def measure_router(cfg: Any, model: str, ref: dict, quick: bool, seed: int) -> dict:
    """TTFT and token gaps through a real router and colocated worker on loopback (module docstring, 3)."""
    import grpc

    from proto import pdserve_pb2, pdserve_pb2_grpc
    from router import RouterConfig, RouterServer, StaticWorkerSource

    rng = random.Random(seed + 1)
    router = None
    apart = _WorkerApart(cfg)
    info = apart.__enter__()
    try:
        router = RouterServer(RouterConfig(model=model, mode="colocated", serve_metrics=False),
                              StaticWorkerSource([info])).start()
        vocab = ref["vocab_size"]
        with grpc.insecure_channel(router.address) as ch:
            stub = pdserve_pb2_grpc.PDServeStub(ch)

            def run(max_tokens: int) -> list[tuple[float, int]]:
                req = pdserve_pb2.GenerateRequest(token_ids=[rng.randrange(vocab) for _ in range(ref["prompt_tokens"])],
                                                  max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                t0 = time.perf_counter()
                got = [(time.perf_counter() - t0, len(r.token_ids)) for r in stub.Generate(req, timeout=120)]
                return [(t, k) for t, k in got if k]

            for _ in range(3):  # connections, threads and the worker's first steps
                run(4)
            ttfts = [run(1)[0][0] for _ in range(8 if quick else 30)]
            def gap(got: list[tuple[float, int]]) -> Optional[float]:
                n_after = sum(k for _, k in got[1:])
                return (got[-1][0] - got[0][0]) / n_after if n_after else None

            gaps = [g for g in (gap(run(ref["stream_tokens"])) for _ in range(2 if quick else 5)) if g is not None]
            batch = int(ref.get("batch") or 0)
            batch_gaps: list[float] = []
            cpu0, streamed = time.process_time(), 0  # this process: the router and the client
            if batch > 1:  # the same streams, `batch` at once: the worker steps them together
                with ThreadPoolExecutor(batch) as ex:
                    for _ in range(2 if quick else 3):
                        got = list(ex.map(lambda _i: run(ref["stream_tokens"]), range(batch)))
                        batch_gaps += [g for g in map(gap, got) if g is not None]
                        streamed += sum(k for stream in got for _, k in stream)
            else:
                for _ in range(2 if quick else 3):
                    streamed += sum(k for _, k in run(ref["stream_tokens"]))
            cpu_per_token = (time.process_time() - cpu0) / max(1, streamed)
    finally:
        if router is not None:
            router.stop()
        apart.__exit__(None, None, None)
    ttft, one = statistics.median(ttfts), statistics.median(gaps)
    pair = measure_pair_ttft(cfg, model, ref, quick, seed)
    out = {**ref, "worker_apart": apart.apart, "ttft_s": ttft, "ttft_samples_s": ttfts, "token_gap_s": one,
           "token_gap_samples_s": gaps,
           "per_request_raw_s": ttft - ref["engine_prefill_s"], "pair_ttft_s": pair,
           "per_request_pair_raw_s": pair - ref["engine_prefill_s"], "cpu_per_token_s": cpu_per_token}
    excess1 = one - ref["engine_decode_s"]
    if batch_gaps:  # excess(B) = per_step + B x per_token, at B = 1 and B = batch
        many = statistics.median(batch_gaps)
        per_token = ((many - ref["engine_decode_batch_s"]) - excess1) / (batch - 1)
        out.update(token_gap_batch_s=many, token_gap_batch_samples_s=batch_gaps, per_token_raw_s=per_token,
                   per_step_raw_s=excess1 - max(0.0, per_token))
    else:  # one point: all of it per token, as before the second point was measured
        out.update(per_token_raw_s=excess1, per_step_raw_s=0.0)
    return out


def measure_pair_ttft(cfg: Any, model: str, ref: dict, quick: bool, seed: int) -> float:
    """Median TTFT of the same short prompts through a router and a prefill + decode pair (KV over the
    same-process transport, so the link is not counted): the disaggregated path's own per-request cost
    (a Reserve on the decode worker, the Prefill stream, the first token back) against the engine's prefill."""
    import grpc

    from decode_worker import DecodeWorker, DecodeWorkerConfig
    from kvtransfer import InprocStore
    from prefill_worker import PrefillWorker, PrefillWorkerConfig
    from proto import pdserve_pb2, pdserve_pb2_grpc
    from router import RouterConfig, RouterServer, StaticWorkerSource

    rng = random.Random(seed + 2)
    store = InprocStore()
    workers: list = []
    router = None
    try:
        workers.append(PrefillWorker(PrefillWorkerConfig("profile-p0", engine=cfg, kv_store=store, kv_backend="inproc",
                                                         serve_metrics=False)).start())
        workers.append(DecodeWorker(DecodeWorkerConfig("profile-d0", engine=cfg, kv_store=store, kv_backend="inproc",
                                                       serve_metrics=False)).start())
        router = RouterServer(RouterConfig(model=model, serve_metrics=False),
                              StaticWorkerSource([w.info for w in workers])).start()
        vocab = workers[0].engine.model_config.vocab_size
        with grpc.insecure_channel(router.address) as ch:
            stub = pdserve_pb2_grpc.PDServeStub(ch)

            def first(max_tokens: int) -> float:
                req = pdserve_pb2.GenerateRequest(token_ids=[rng.randrange(vocab) for _ in range(ref["prompt_tokens"])],
                                                  max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                t0 = time.perf_counter()
                t = None
                for r in stub.Generate(req, timeout=120):
                    if t is None and r.token_ids:
                        t = time.perf_counter() - t0
                return t if t is not None else math.inf

            for _ in range(3):
                first(2)
            return statistics.median(first(2) for _ in range(8 if quick else 30))
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()
