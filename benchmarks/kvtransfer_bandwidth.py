"""Bandwidth and fixed cost of a kvtransfer pair channel against raw links, in one run.

Lifecycle: the script serves a TCPStore on a free port, spawns one receiver
process, and (as the sender) measures, for each payload size, four ways of
moving the same bytes between the two processes on loopback, interleaved
round by round so that load changes on the host hit all of them alike:

- ``gloo raw``: one contiguous uint8 tensor through a ProcessGroupGloo send/recv
  plus a 1-byte reply (the ceiling for the channel, which uses gloo underneath);
- ``tcp``: ``sendall`` / ``recv_into`` on a loopback TCP connection, 1-byte reply;
- ``kv contig``: a paged fp16 KV cache (8 layers, 8 KV heads x 128; block size 16
  on the sender, 32 on the receiver) with block ids in order, sent layer by
  layer through ``KVEndpoint.send`` into a posted ``KVEndpoint.recv``; timed from
  ``send()`` to the sender's DONE, which needs the receiver's acknowledgement
  that every byte is in place (contiguous blocks travel zero-copy);
- ``kv shuffled``: the same with shuffled block ids on both sides, so every
  byte is gathered on the sender and scattered on the receiver.

Both kv ways run three times, interleaved: over a pair of endpoints with ``shm=False`` (the socket: gloo over
loopback, what two workers on one host used before 29 Nov), over a pair that negotiated shared memory
(kvtransfer/shm.py, the default on one host: the ring of slots), and over that pair from a sender cache in a shared
segment (an engine's with ``kv_cache_shared``, as a cluster's prefill workers allocate it: the receiver pulls the
rows from it in place); the table gives each against the socket.

With ``--kv-cache-dtype int8``, also per prompt: a prompt of each ``--prompt-tokens`` length in the
``bench`` model's KV geometry (12 layers, 4 KV heads x 64) sent from a float32 cache and from an int8
cache (each row 64 values + its 4-byte float32 scale, as the engine stores it), interleaved: bytes per
prompt token and transfer time, int8 against float32.

Then the fixed cost: the median time of a one-block transfer (16 tokens, one
layer, 1 head x 64 fp32 = 8 KiB) against a raw gloo send of the same bytes plus
a 1-byte reply. Results print as a table (rich) and optionally as JSON.

``--copy-bound``: instead, in this one process, the receiver's copy of a pull alone (``kvtransfer.shm.pull_rows``
from a shared cache, its mapping cached as a pair caches it; per layer and all layers in one frame) against one
``Tensor.copy_`` of the same bytes (this thread's memcpy): how near the pull's copy is to the copy it cannot beat.

``--same-node DEVICE``: instead, issue 43's same-node goal: an 8B-shaped prompt (32 layers, 8 KV heads x 128,
bf16, blocks of 16; ``--prompt-tokens``, default 1,000 tokens = 131 MB) from a prefill-like sender whose cache is
shareable (``allocate_kv_caches(shared=True)``) to a receiver process on this node, all layers ready at once,
layer by layer, and all at once into scattered decode-side blocks (as a running decode worker's are): on ``cuda`` both caches on the GPU and the pair on CUDA IPC (two processes on one GPU; the goal is
>= 100 GB/s), on ``cpu`` the shared-memory pull; against one in-process copy of the same bytes on that device.

Usage: python benchmarks/kvtransfer_bandwidth.py [--sizes-mib 1 4 16 64 256] [--reps 5] [--json out.json]
       python benchmarks/kvtransfer_bandwidth.py --same-node cuda [--prompt-tokens 1000] [--reps 5]
       python benchmarks/kvtransfer_bandwidth.py --copy-bound --sizes-mib 64 128 [--reps 5]
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import random
import socket
import statistics
import time

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.kv_cache import allocate_kv_caches, share_kv_caches


GIB = float(1 << 30)
LAYERS, HEADS, HEAD_DIM, DTYPE = 8, 8, 128, torch.float16
SRC_BS, DST_BS = 16, 32
ROW = HEADS * HEAD_DIM * 2  # bytes of one token's K (or V) in one layer


def _kv_geometry(nbytes: int) -> tuple[int, int, int]:
    """Tokens, sender blocks, receiver blocks for a KV payload of about ``nbytes``."""
    tokens = max(1, nbytes // (LAYERS * 2 * ROW))
    return tokens, -(-tokens // SRC_BS), -(-tokens // DST_BS)


def _cache(num_blocks: int, block_size: int, layers: int = LAYERS, heads: int = HEADS, dim: int = HEAD_DIM,
           dtype=DTYPE, fill: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A sender's cache (random, a tensor per layer), or with ``fill`` False a receiver's: zeros laid out as a
    decode worker's engine lays its cache out (``allocate_kv_caches``: every layer in one allocation)."""
    if not fill:  # (``dim`` is the row's width: an int8 row carries its 4-byte scale after head_dim values)
        mc = ModelConfig(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=dim - 4 if dtype == torch.int8 else dim)
        return allocate_kv_caches(mc, num_blocks, block_size, dtype, torch.device("cpu"))
    return [(torch.randn(num_blocks, block_size, heads, dim).to(dtype),
             torch.randn(num_blocks, block_size, heads, dim).to(dtype)) for _ in range(layers)]


def _shuffled(n: int, seed: int) -> list[int]:
    ids = list(range(n))
    random.Random(seed).shuffle(ids)
    return ids


def receiver(conn, store_port: int, threads: int) -> None:
    """The receiving process: answers one command per measured operation."""
    torch.set_num_threads(threads)
    from kvtransfer import KVEndpoint

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 1, 2, datetime.timedelta(seconds=120))
    lsock = socket.create_server(("127.0.0.1", 0))
    conn.send(lsock.getsockname()[1])
    sock, _ = lsock.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    eps = {"shm": KVEndpoint("bench-d", f"tcp://127.0.0.1:{store_port}", timeout_s=120.0, shm=True),
           "sock": KVEndpoint("bench-d-sock", f"tcp://127.0.0.1:{store_port}", timeout_s=120.0, shm=False)}
    bufs: dict[int, torch.Tensor] = {}
    caches: dict[tuple, list] = {}
    pending = {}
    one = torch.ones(1, dtype=torch.uint8)
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        if cmd == "raw":  # receive n bytes, reply 1 byte
            (n,) = args
            buf = bufs.setdefault(n, torch.empty(n, dtype=torch.uint8))
            conn.send("ready")
            pg.recv([buf], 0, 0).wait()
            pg.send([one], 0, 1).wait()
        elif cmd == "tcp":
            (n,) = args
            buf = bufs.setdefault(n, torch.empty(n, dtype=torch.uint8))
            view = memoryview(buf.numpy())
            conn.send("ready")
            got = 0
            while got < n:
                got += sock.recv_into(view[got:], n - got)
            sock.sendall(b"k")
        elif cmd == "kv":  # post a receive; the sender times send() -> its DONE (our ack)
            geom, rid, tokens, ids, way = args
            cache = caches.get(geom)
            if cache is None:
                caches.clear()
                cache = caches[geom] = _cache(*geom, fill=False)
            ep = eps[way]
            pending[rid] = (ep, ep.recv("bench-p" if way == "shm" else "bench-p-sock", rid, cache, ids, tokens))
            conn.send("ready")
        elif cmd == "check":
            (rid,) = args
            ep, h = pending.pop(rid)
            ep.wait(h, 120)
            conn.send(ep.poll(h).value)
    for ep in eps.values():
        ep.shutdown()
    sock.close()
    lsock.close()


SAME_NODE = dict(layers=32, heads=8, dim=128, dtype=torch.bfloat16, block=16)
"""The same-node goal's prompt: Llama-3.1-8B's KV geometry."""


def _same_node_caches(device: str, blocks: int, shared: bool) -> list:
    g = SAME_NODE
    mc = ModelConfig(num_hidden_layers=g["layers"], num_attention_heads=4 * g["heads"], num_key_value_heads=g["heads"],
                     head_dim=g["dim"])
    caches = allocate_kv_caches(mc, blocks, g["block"], g["dtype"], torch.device(device), shared=shared)
    if shared:
        for k, v in caches:
            k.normal_()
            v.normal_()
    return caches


def same_node_receiver(conn, store_port: int, device: str, blocks: int) -> None:
    """The decode-like side of ``--same-node``: a private cache, a receive posted per command."""
    from kvtransfer import KVEndpoint

    torch.set_num_threads(1)
    ep = KVEndpoint("node-d", f"tcp://127.0.0.1:{store_port}", backend="nccl" if device == "cuda" else "gloo",
                    timeout_s=120.0, shm=True)
    cache = _same_node_caches(device, blocks, shared=False)
    conn.send("up")
    while True:
        cmd, *a = conn.recv()
        if cmd == "stop":
            break
        rid, tokens, ids = a
        h = ep.recv("node-p", rid, cache, ids, tokens)
        conn.send("ready")
        ep.wait(h, 120)
        conn.send((ep.poll(h).value, ep.failure(h)))
    ep.shutdown()


def same_node(device: str, tokens: int, reps: int) -> None:
    """``--same-node`` (see the module docstring)."""
    from kvtransfer import KVEndpoint, TransferState

    g = SAME_NODE
    blocks = -(-tokens // g["block"])
    nbytes = tokens * g["layers"] * 2 * g["heads"] * g["dim"] * 2
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=same_node_receiver, args=(child, store.port, device, blocks), daemon=True)
    proc.start()
    try:
        ep = KVEndpoint("node-p", f"tcp://127.0.0.1:{store.port}", backend="nccl" if device == "cuda" else "gloo",
                        timeout_s=120.0, shm=True)
        cache = _same_node_caches(device, blocks, shared=True)
        assert conn.recv() == "up"
        ids = list(range(blocks))
        # the decode side's blocks as a running server hands them out: anywhere in its cache, so every block is a
        # stretch of its own (the first two ways have the same order on both sides: one stretch)
        scattered = random.Random(0).sample(range(blocks), blocks)
        times: dict[str, list[float]] = {"all layers ready": [], "layer by layer": [], "scattered blocks": []}
        links = set()
        for rep in range(reps + 1):
            for way in times:
                rid = f"{way[:3]}-{rep}"
                conn.send(("recv", rid, tokens, scattered if way == "scattered blocks" else ids))
                assert conn.recv() == "ready"
                t0 = time.perf_counter()
                h = ep.send("node-d", rid, cache, ids, tokens, layers_ready=way != "layer by layer")
                if way == "layer by layer":
                    for layer in range(g["layers"]):
                        ep.layer_ready(h, layer)
                state = ep.wait(h, 120)
                dt = time.perf_counter() - t0
                got = conn.recv()
                if state != TransferState.DONE or got[0] != "done":
                    raise RuntimeError(f"transfer {rid} failed: {ep.failure(h)} / {got[1]}")
                links |= {s.link for s in ep.take_completed()}
                if rep:
                    times[way].append(dt)
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        other = torch.empty_like(flat)
        copy_ts = []
        for _ in range(reps + 1):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            other.copy_(flat)
            if device == "cuda":
                torch.cuda.synchronize()
            copy_ts.append(time.perf_counter() - t0)
        copy = nbytes / statistics.median(copy_ts[1:])
        print(f"same node, {device}: {tokens} tokens of an 8B-shaped prompt = {nbytes / 1e6:.0f} MB, link "
              f"{'/'.join(sorted(links))}; one in-process copy {copy / 1e9:.1f} GB/s", flush=True)
        for way, ts in times.items():
            rate = nbytes / statistics.median(ts)
            print(f"  {way}: {statistics.median(ts) * 1e3:.2f} ms median, {rate / 1e9:.1f} GB/s "
                  f"({rate / copy:.2f}x the copy; goal on a GPU >= 100 GB/s)", flush=True)
        ep.shutdown()
    finally:
        conn.send(("stop",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def copy_bound(sizes_mib: list[int], reps: int) -> None:
    """``--copy-bound`` (see the module docstring): GiB/s of pull_rows per layer, in one frame, and of memcpy."""
    from kvtransfer.layout import CacheLayout, TokenRows
    from kvtransfer.shm import pull_descriptor, pull_rows
    from transport.shared_memory import map_segment

    class Peer:  # the receiver side of a pair: the sender's segment mapped once
        counts = {"pull_frames": 0}
        mapped: dict = {}

        def peer_segment(self, h):
            if h not in self.mapped:
                self.mapped[h] = map_segment(h)
            return self.mapped[h]

    peer = Peer()
    for mib in sizes_mib:
        tokens = (mib << 20) // (LAYERS * 2 * ROW)
        nb = -(-tokens // SRC_BS)
        src = share_kv_caches(_cache(nb, SRC_BS))
        dst = _cache(-(-tokens // DST_BS), DST_BS)
        sr = TokenRows(CacheLayout.of(src), list(range(nb)), tokens, "src")
        dr = TokenRows(CacheLayout.of(dst), list(range(len(dst[0][0]))), tokens, "dst")
        nbytes = tokens * LAYERS * 2 * ROW
        a = torch.empty(nbytes, dtype=torch.uint8)
        b = torch.ones_like(a)
        rates = {}
        for name, frames in (("pull per layer", [(i, i + 1) for i in range(LAYERS)]), ("pull one frame", [(0, LAYERS)]),
                             ("memcpy", None)):
            ts = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                if frames is None:
                    a.copy_(b)
                for lo, hi in frames or ():
                    desc = pull_descriptor(src, sr, lo, hi, 32 << 10)
                    pull_rows(peer, torch.frombuffer(bytearray(desc), dtype=torch.uint8), lo, hi, tokens, ROW, dst, dr)
                ts.append(time.perf_counter() - t0)
            rates[name] = nbytes / GIB / statistics.median(ts[1:])
        print(f"{mib} MiB: " + ", ".join(f"{k} {v:.2f} GiB/s ({v / rates['memcpy']:.2f}x memcpy)"
                                        for k, v in rates.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=5, help="measured rounds per size (after one warm-up round)")
    ap.add_argument("--small-count", type=int, default=200)
    ap.add_argument("--chunk-mib", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                    help="int8: also compare a prompt's transfer from an int8 cache with float32 (bench geometry)")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=None,
                    help="prompt lengths: --kv-cache-dtype int8's (default 512 2048 8192), --same-node's (default 1000)")
    ap.add_argument("--same-node", choices=("cpu", "cuda"), default=None,
                    help="only issue 43's same-node hand-off: an 8B-shaped prompt between two processes")
    ap.add_argument("--copy-bound", action="store_true",
                    help="only the receiver's copy of a pull against this thread's memcpy, in this process")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.copy_bound:
        copy_bound(args.sizes_mib, args.reps)
        return
    if args.same_node:
        same_node(args.same_node, (args.prompt_tokens or [1000])[0], args.reps)
        return
    from rich.console import Console
    from rich.table import Table

    from kvtransfer import KVEndpoint, TransferState

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child_conn, store.port, args.threads), daemon=True)
    proc.start()
    results: dict = {"sizes": [], "fixed": {}, "reps": args.reps, "chunk_mib": args.chunk_mib}
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 0, 2, datetime.timedelta(seconds=120))
        sock = socket.create_connection(("127.0.0.1", conn.recv()))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        chunk = int(args.chunk_mib * (1 << 20))
        eps = {"shm": KVEndpoint("bench-p", store, timeout_s=120.0, chunk_bytes=chunk, shm=True),
               "sock": KVEndpoint("bench-p-sock", store, timeout_s=120.0, chunk_bytes=chunk, shm=False)}
        ack = torch.empty(1, dtype=torch.uint8)
        seq = iter(range(1 << 30))

        def raw(src: torch.Tensor) -> float:
            conn.send(("raw", src.numel()))
            assert conn.recv() == "ready"
            t0 = time.perf_counter()
            pg.send([src], 1, 0).wait()
            pg.recv([ack], 1, 1).wait()
            return time.perf_counter() - t0

        def tcp(src: torch.Tensor) -> float:
            conn.send(("tcp", src.numel()))
            assert conn.recv() == "ready"
            t0 = time.perf_counter()
            sock.sendall(memoryview(src.numpy()))
            sock.recv(1)
            return time.perf_counter() - t0

        def kv(cache, ids, tokens, dst_geom, dst_ids, per_layer: bool, way: str = "sock") -> float:
            rid = f"kv-{next(seq)}"
            conn.send(("kv", dst_geom, rid, tokens, dst_ids, way))
            assert conn.recv() == "ready"
            ep = eps[way]
            t0 = time.perf_counter()
            h = ep.send("bench-d" if way == "shm" else "bench-d-sock", rid, cache, ids, tokens,
                        layers_ready=not per_layer)
            if per_layer:
                for layer in range(len(cache)):
                    ep.layer_ready(h, layer)
            state = ep.wait(h, 120)
            dt = time.perf_counter() - t0
            conn.send(("check", rid))
            if state != TransferState.DONE or conn.recv() != "done":
                raise RuntimeError(f"transfer {rid} failed: {ep.failure(h)}")
            return dt

        for mib in args.sizes_mib:
            n = mib << 20
            tokens, src_blocks, dst_blocks = _kv_geometry(n)
            src = torch.randint(0, 255, (n,), dtype=torch.uint8)
            cache = _cache(src_blocks, SRC_BS)
            shared = share_kv_caches(cache)  # as a prefill worker's: receivers pull from it
            dst_geom = (dst_blocks, DST_BS)
            order_s, order_d = list(range(src_blocks)), list(range(dst_blocks))
            shuf_s, shuf_d = _shuffled(src_blocks, 1), _shuffled(dst_blocks, 2)
            t: dict[str, list[float]] = {"gloo": [], "tcp": [], "kv_contig": [], "kv_shuffled": [],
                                         "shm_contig": [], "shm_shuffled": [], "pull_contig": [], "pull_shuffled": []}
            for rep in range(args.reps + 1):  # interleaved, so load changes hit every method alike
                sample = {"gloo": raw(src), "tcp": tcp(src),
                          "kv_contig": kv(cache, order_s, tokens, dst_geom, order_d, True),
                          "kv_shuffled": kv(cache, shuf_s, tokens, dst_geom, shuf_d, True),
                          "shm_contig": kv(cache, order_s, tokens, dst_geom, order_d, True, "shm"),
                          "shm_shuffled": kv(cache, shuf_s, tokens, dst_geom, shuf_d, True, "shm"),
                          "pull_contig": kv(shared, order_s, tokens, dst_geom, order_d, True, "shm"),
                          "pull_shuffled": kv(shared, shuf_s, tokens, dst_geom, shuf_d, True, "shm")}
                if rep:
                    for k, v in sample.items():
                        t[k].append(v)
            kv_bytes = tokens * LAYERS * 2 * ROW
            row = {"bytes": n, "kv_bytes": kv_bytes}
            for k, v in t.items():
                row[f"{k}_s"] = statistics.median(v)
                row[f"{k}_gibps"] = (kv_bytes if k.startswith(("kv", "shm", "pull")) else n) / row[f"{k}_s"] / GIB
            results["sizes"].append(row)
            del src, cache, shared
        if args.kv_cache_dtype == "int8":  # per prompt, bench geometry: float32 rows vs int8 rows + scale
            results["per_prompt"] = []
            for n_tok in args.prompt_tokens or [512, 2048, 8192]:
                nb = -(-n_tok // 16)
                row = {"tokens": n_tok}
                caches = {"float32": (_cache(nb, 16, 12, 4, 64, torch.float32), (nb, 16, 12, 4, 64, torch.float32)),
                          "int8": (_cache(nb, 16, 12, 4, 68, torch.int8), (nb, 16, 12, 4, 68, torch.int8))}
                ts: dict[str, list[float]] = {k: [] for k in caches}
                for rep in range(args.reps + 1):
                    for k, (c, geom) in caches.items():
                        dt = kv(c, list(range(nb)), n_tok, geom, list(range(nb)), True)
                        if rep:
                            ts[k].append(dt)
                for k in caches:
                    row[f"{k}_bytes_per_token"] = 12 * 2 * 4 * (64 * 4 if k == "float32" else 68)
                    row[f"{k}_s"] = statistics.median(ts[k])
                results["per_prompt"].append(row)
        # fixed cost: one block of 16 tokens, one layer, 1 head x 64 fp32 = 8 KiB
        small = _cache(4, 16, layers=1, heads=1, dim=64, dtype=torch.float32)
        nb = 16 * 64 * 4 * 2
        buf = torch.ones(nb, dtype=torch.uint8)
        kv_t, raw_t, shm_t = [], [], []
        for i in range(args.small_count + 1):
            a = kv(small, [2], 16, (4, 16, 1, 1, 64, torch.float32), [1], False)
            b = raw(buf)
            c = kv(small, [2], 16, (4, 16, 1, 1, 64, torch.float32), [1], False, "shm")
            if i:
                kv_t.append(a)
                raw_t.append(b)
                shm_t.append(c)
        results["fixed"] = {"bytes": nb, "kv_one_block_s": statistics.median(kv_t),
                            "gloo_round_trip_s": statistics.median(raw_t),
                            "kv_one_block_p90_s": sorted(kv_t)[int(0.9 * len(kv_t))],
                            "shm_one_block_s": statistics.median(shm_t)}
        conn.send(("stop",))
        for ep in eps.values():
            ep.shutdown()
        sock.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()

    table = Table(title=f"kvtransfer vs raw links on loopback, GiB/s (median of {args.reps}, interleaved; ring and "
                        "pull: x the socket's kv)")
    for col in ("payload", "gloo raw", "tcp", "kv contig", "kv shuffled", "contig/gloo", "shuffled/gloo",
                "ring contig", "ring shuffled", "pull contig", "pull shuffled"):
        table.add_column(col, justify="right")
    for r in results["sizes"]:
        g = r["gloo_gibps"]
        table.add_row(f"{r['bytes'] >> 20} MiB", f"{g:.2f}", f"{r['tcp_gibps']:.2f}", f"{r['kv_contig_gibps']:.2f}",
                      f"{r['kv_shuffled_gibps']:.2f}", f"{r['kv_contig_gibps'] / g:.0%}",
                      f"{r['kv_shuffled_gibps'] / g:.0%}",
                      *(f"{r[f'{w}_{o}_gibps']:.2f} ({r[f'{w}_{o}_gibps'] / r[f'kv_{o}_gibps']:.2f}x)"
                        for w in ("shm", "pull") for o in ("contig", "shuffled")))
    Console(width=130).print(table)
    f = results["fixed"]
    print(f"fixed cost, one-block transfer ({f['bytes']} B): kvtransfer median {f['kv_one_block_s'] * 1e3:.3f} ms "
          f"(p90 {f['kv_one_block_p90_s'] * 1e3:.3f} ms, n={args.small_count}); "
          f"raw gloo send + 1-byte reply {f['gloo_round_trip_s'] * 1e3:.3f} ms; "
          f"shared memory {f['shm_one_block_s'] * 1e3:.3f} ms")
    for r in results.get("per_prompt", []):
        print(f"prompt of {r['tokens']} tokens (bench geometry): float32 {r['float32_bytes_per_token']} B/token "
              f"{r['float32_s'] * 1e3:.2f} ms, int8 {r['int8_bytes_per_token']} B/token {r['int8_s'] * 1e3:.2f} ms: "
              f"bytes x{r['int8_bytes_per_token'] / r['float32_bytes_per_token']:.3f}, "
              f"time x{r['int8_s'] / r['float32_s']:.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
