"""Bandwidth and fixed cost of a kvtransfer pair channel against raw links, in one run.

Lifecycle: the script serves a TCPStore on a free port, spawns one receiver
process, and (as the sender) measures, for each payload size, three ways of
moving the same bytes between the two processes on loopback:

- ``gloo raw``: one contiguous uint8 tensor through a ProcessGroupGloo send/recv
  (the ceiling for the channel, which uses gloo underneath);
- ``tcp socket``: ``sendall`` / ``recv_into`` on a loopback TCP connection;
- ``kvtransfer``: a paged KV cache (block size 16 on the sender, 32 on the
  receiver, shuffled block ids so gather and scatter are real) sent layer by
  layer through ``KVEndpoint.send`` and received by ``KVEndpoint.recv``;
  timed from ``send()`` to the sender's DONE, which needs the receiver's
  acknowledgement that every byte is in place.

Then the fixed cost: the median time of a one-block transfer (16 tokens, one
layer, 8 KiB) against a raw gloo round trip of the same bytes plus a 1-byte
reply. Results print as a table (rich) and optionally as JSON.

Usage: python benchmarks/kvtransfer_bandwidth.py [--sizes-mib 1 4 16 64 256] [--reps 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = float(1 << 30)
LAYERS, HEADS, HEAD_DIM, DTYPE = 8, 8, 128, torch.float16
SRC_BS, DST_BS = 16, 32
ROW = HEADS * HEAD_DIM * 2  # bytes of one token's K (or V) in one layer


def _kv_geometry(nbytes: int) -> tuple[int, int, int]:
    """Tokens, sender blocks, receiver blocks for a KV payload of about ``nbytes``."""
    tokens = max(1, nbytes // (LAYERS * 2 * ROW))
    return tokens, -(-tokens // SRC_BS), -(-tokens // DST_BS)


def _cache(num_blocks: int, block_size: int, layers: int = LAYERS, heads: int = HEADS, dim: int = HEAD_DIM,
           dtype=DTYPE, fill: bool = True):
    mk = (lambda: torch.randn(num_blocks, block_size, heads, dim).to(dtype)) if fill else (
        lambda: torch.zeros(num_blocks, block_size, heads, dim, dtype=dtype))
    return [(mk(), mk()) for _ in range(layers)]


def _shuffled(n: int, seed: int) -> list[int]:
    ids = list(range(n))
    random.Random(seed).shuffle(ids)
    return ids


def receiver(conn, store_port: int, sizes: list[int], reps: int, threads: int) -> None:
    torch.set_num_threads(threads)
    from kvtransfer import KVEndpoint

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 1, 2, datetime.timedelta(seconds=120))
    lsock = socket.create_server(("127.0.0.1", 0))
    conn.send(lsock.getsockname()[1])
    sock, _ = lsock.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ep = KVEndpoint("bench-d", f"tcp://127.0.0.1:{store_port}", timeout_s=120.0)
    small = _cache(4, 16, layers=1, heads=1, dim=64, dtype=torch.float32, fill=False)
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        if cmd == "raw":
            n, count = args
            buf = torch.empty(n, dtype=torch.uint8)
            for _ in range(count + 1):
                pg.recv([buf], 0, 0).wait()
                pg.send([torch.ones(1, dtype=torch.uint8)], 0, 1).wait()
            conn.send("ok")
        elif cmd == "tcp":
            (n,) = args
            buf = bytearray(n)
            view = memoryview(buf)
            for _ in range(reps + 1):
                got = 0
                while got < n:
                    got += sock.recv_into(view[got:], n - got)
                sock.sendall(b"k")
            conn.send("ok")
        elif cmd == "kv":
            (n,) = args
            tokens, _, dst_blocks = _kv_geometry(n)
            cache = _cache(dst_blocks, DST_BS, fill=False)
            ids = _shuffled(dst_blocks, 2)
            hs = [ep.recv("bench-p", f"kv-{n}-{i}", cache, ids, tokens) for i in range(reps + 1)]
            conn.send("posted")
            for h in hs:
                ep.wait(h, 120)
            conn.send([ep.poll(h).value for h in hs])
            del cache
        elif cmd == "small":
            (count,) = args
            hs = [ep.recv("bench-p", f"small-{i}", small, [1], 16) for i in range(count)]
            conn.send("posted")
            for h in hs:
                ep.wait(h, 120)
            conn.send("ok")
    ep.shutdown()
    sock.close()
    lsock.close()


def _time(fn, reps: int) -> list[float]:
    fn()  # warm-up (connections, allocations)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--small-count", type=int, default=300)
    ap.add_argument("--chunk-mib", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvtransfer import KVEndpoint, TransferState
    from rich.console import Console
    from rich.table import Table

    sizes = [m << 20 for m in args.sizes_mib]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child_conn, store.port, sizes, args.reps, args.threads), daemon=True)
    proc.start()
    results = {"sizes": [], "fixed": {}}
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 0, 2, datetime.timedelta(seconds=120))
        sock = socket.create_connection(("127.0.0.1", conn.recv()))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ep = KVEndpoint("bench-p", store, timeout_s=120.0, chunk_bytes=int(args.chunk_mib * (1 << 20)))
        ack = torch.empty(1, dtype=torch.uint8)
        for n in sizes:
            row = {"bytes": n}
            src = torch.randint(0, 255, (n,), dtype=torch.uint8)
            conn.send(("raw", n, args.reps))
            t = _time(lambda: (pg.send([src], 1, 0).wait(), pg.recv([ack], 1, 1).wait()), args.reps)
            assert conn.recv() == "ok"
            row["gloo_raw_s"] = statistics.median(t)
            payload = memoryview(src.numpy())
            conn.send(("tcp", n))
            t = _time(lambda: (sock.sendall(payload), sock.recv(1)), args.reps)
            assert conn.recv() == "ok"
            row["tcp_s"] = statistics.median(t)
            del src, payload
            tokens, src_blocks, _ = _kv_geometry(n)
            cache = _cache(src_blocks, SRC_BS)
            ids = _shuffled(src_blocks, 1)
            conn.send(("kv", n))
            assert conn.recv() == "posted"
            it = iter(range(args.reps + 1))

            def one() -> None:
                h = ep.send("bench-d", f"kv-{n}-{next(it)}", cache, ids, tokens)
                for layer in range(LAYERS):
                    ep.layer_ready(h, layer)
                if ep.wait(h, 120) != TransferState.DONE:
                    raise RuntimeError(ep.failure(h))
            t = _time(one, args.reps)
            states = conn.recv()
            assert all(s == "done" for s in states), states
            row["kv_s"] = statistics.median(t)
            row["kv_bytes"] = tokens * LAYERS * 2 * ROW
            results["sizes"].append(row)
            del cache
        # fixed cost: one block of 16 tokens, one layer, 1 head x 64 fp32 = 8 KiB
        small = _cache(4, 16, layers=1, heads=1, dim=64, dtype=torch.float32)
        conn.send(("small", args.small_count + 1))
        assert conn.recv() == "posted"
        it = iter(range(args.small_count + 1))

        def tiny() -> None:
            h = ep.send("bench-d", f"small-{next(it)}", small, [2], 16, layers_ready=True)
            if ep.wait(h, 120) != TransferState.DONE:
                raise RuntimeError(ep.failure(h))
        t = _time(tiny, args.small_count)
        assert conn.recv() == "ok"
        results["fixed"]["kv_one_block_s"] = statistics.median(t)
        nb = 16 * 64 * 4 * 2
        buf = torch.ones(nb, dtype=torch.uint8)
        conn.send(("raw", nb, args.small_count))
        t = _time(lambda: (pg.send([buf], 1, 0).wait(), pg.recv([ack], 1, 1).wait()), args.small_count)
        assert conn.recv() == "ok"
        results["fixed"]["gloo_round_trip_s"] = statistics.median(t)
        results["fixed"]["bytes"] = nb
        conn.send(("stop",))
        ep.shutdown()
        sock.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()

    table = Table(title=f"kvtransfer vs raw links on loopback (median of {args.reps}; GiB/s)")
    for col in ("payload", "gloo raw", "tcp socket", "kvtransfer", "kv / gloo"):
        table.add_column(col, justify="right")
    for r in results["sizes"]:
        g, s, k = r["bytes"] / r["gloo_raw_s"] / GIB, r["bytes"] / r["tcp_s"] / GIB, r["kv_bytes"] / r["kv_s"] / GIB
        r.update(gloo_gibps=g, tcp_gibps=s, kv_gibps=k, kv_over_gloo=k / g)
        table.add_row(f"{r['bytes'] >> 20} MiB", f"{g:.2f}", f"{s:.2f}", f"{k:.2f}", f"{k / g:.0%}")
    Console().print(table)
    f = results["fixed"]
    print(f"fixed cost, one-block transfer ({f['bytes']} B): kvtransfer {f['kv_one_block_s'] * 1e3:.3f} ms "
          f"(median of {args.small_count}); raw gloo send + 1-byte reply {f['gloo_round_trip_s'] * 1e3:.3f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
