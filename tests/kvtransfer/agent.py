"""A worker-like child process hosting one KVEndpoint, driven by commands over a pipe.

Lifecycle: ``Agent.start(name, store_url, spec)`` spawns a process that builds a
paged KV cache (random from a seed, or zeros), creates a gloo ``KVEndpoint``
and answers commands until ``stop()`` (or is killed by the test, which is the
point of some tests). Checksums are computed here by plain per-token indexing,
independently of kvtransfer's own gather/scatter code.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass

import torch


@dataclass
class CacheSpec:
    """Shape of an agent's paged KV cache."""

    num_layers: int = 3
    num_blocks: int = 64
    block_size: int = 16
    num_kv_heads: int = 2
    head_dim: int = 16
    dtype: str = "float32"
    seed: int | None = None
    """Random contents from this seed; None means zeros (a receiver)."""
    alt_dtype: str | None = None
    """Also hold a second cache of this dtype (to send mismatched transfers from)."""
    shared: bool = False
    """The cache lives in one ``transport.shared_memory`` segment (as an engine's with ``kv_cache_shared``; on CUDA
    one ``transport.cuda_ipc`` segment)."""
    device: str = "cpu"
    """Where the cache lives; "cuda" makes the agent's endpoint an nccl one."""
    one_allocation: bool = True
    """A zeros cache is laid out as an engine lays one out (``allocate_kv_caches``: every layer in one allocation);
    False: a tensor per layer."""


def make_cache(spec: CacheSpec) -> list[tuple[torch.Tensor, torch.Tensor]]:
    dt = getattr(torch, spec.dtype)
    shape = (spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if spec.device != "cpu":  # the same contents, then on the device (one CUDA IPC segment where shared)
        host = make_cache(CacheSpec(**{**spec.__dict__, "device": "cpu", "shared": False, "one_allocation": False}))
        if not spec.shared and not (spec.seed is None and spec.one_allocation):
            return [(k.to(spec.device), v.to(spec.device)) for k, v in host]
        from engine.config import ModelConfig
        from engine.kv_cache import allocate_kv_caches

        mc = ModelConfig(num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_kv_heads,
                         num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim)
        out = allocate_kv_caches(mc, spec.num_blocks, spec.block_size, dt, torch.device(spec.device),
                                 shared=spec.shared)
        for (k, v), (hk, hv) in zip(out, host):
            k.copy_(hk)
            v.copy_(hv)
        return out
    if spec.shared:  # as a prefill worker's engine lays it out (kv_cache_shared)
        from engine.kv_cache import share_kv_caches

        return share_kv_caches(make_cache(CacheSpec(**{**spec.__dict__, "shared": False})))
    if spec.seed is None and spec.one_allocation:
        from engine.config import ModelConfig
        from engine.kv_cache import allocate_kv_caches

        mc = ModelConfig(num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_kv_heads,
                         num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim)
        return allocate_kv_caches(mc, spec.num_blocks, spec.block_size, dt, torch.device("cpu"))
    if spec.seed is None:
        return [(torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt)) for _ in range(spec.num_layers)]
    g = torch.Generator().manual_seed(spec.seed)
    return [(torch.randn(shape, generator=g).to(dt), torch.randn(shape, generator=g).to(dt))
            for _ in range(spec.num_layers)]


def token_checksum(cache, block_ids: list[int], num_tokens: int) -> str:
    """sha256 over every layer's K and V rows of tokens 0..num_tokens-1, found one token at a time."""
    bs = cache[0][0].shape[1]
    h = hashlib.sha256()
    for k, v in cache:
        for t in (k, v):
            rows = [t[block_ids[p // bs], p % bs] for p in range(num_tokens)]
            h.update(torch.stack(rows).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def untouched_except(cache, used: list[tuple[list[int], int]]) -> bool:
    """True if every cache row not covered by (block_ids, num_tokens) pairs is still zero."""
    bs = cache[0][0].shape[1]
    mask = torch.ones(cache[0][0].shape[0], bs, dtype=torch.bool)
    for blocks, n in used:
        for p in range(n):
            mask[blocks[p // bs], p % bs] = False
    return all(not t.cpu()[mask].any() for pair in cache for t in pair)


def _main(conn, name: str, store_url: str, spec: CacheSpec, timeout_s: float, chunk_bytes: int, shm: bool = True,
          shm_dir: str | None = None, no_pull: bool = False, shm_full: bool = False) -> None:
    torch.set_num_threads(1)
    from kvtransfer import KVEndpoint

    if shm_full:  # this process's /dev/shm has no room for a ring (a container's default is 64 MiB)
        import errno

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device (test)")
        os.posix_fallocate = full
    if no_pull:  # this process cannot map a peer's memory (as in another pid namespace)
        import kvtransfer.shm

        def refuse(handle):
            raise OSError("no access to the peer's memory (test)")
        kvtransfer.shm.map_segment = refuse

    if shm_dir is not None:  # this process sees another /dev/shm (as a second container on one node would)
        import kvtransfer.shm
        from pathlib import Path

        kvtransfer.shm.SHM_DIR = Path(shm_dir)

    cache = make_cache(spec)
    alt = make_cache(CacheSpec(**{**spec.__dict__, "dtype": spec.alt_dtype})) if spec.alt_dtype else None
    ep = KVEndpoint(name, store_url, backend="nccl" if spec.device != "cpu" else "gloo", timeout_s=timeout_s,
                    chunk_bytes=chunk_bytes, shm=shm)
    handles = {}
    conn.send(("ready", os.getpid()))
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "stop":
                ep.shutdown()
                conn.send(("ok",))
                return
            if cmd == "recv":
                key, peer, rid, blocks, n, deadline = args
                handles[key] = ep.recv(peer, rid, cache, blocks, n, deadline_s=deadline)
                out = None
            elif cmd in ("send", "send_alt"):
                key, peer, rid, blocks, n, layers, deadline = args
                src = alt if cmd == "send_alt" else cache
                h = handles[key] = ep.send(peer, rid, src, blocks, n, deadline_s=deadline)
                for i in (range(spec.num_layers) if layers == "all" else layers):
                    ep.layer_ready(h, i)
                out = None
            elif cmd == "layer":
                key, i = args
                ep.layer_ready(handles[key], i)
                out = None
            elif cmd == "wait":
                key, timeout = args
                st = ep.wait(handles[key], timeout)
                out = (st.value, ep.failure(handles[key]))
            elif cmd == "poll":
                (key,) = args
                out = (ep.poll(handles[key]).value, ep.failure(handles[key]))
            elif cmd == "checksum":
                blocks, n = args
                out = token_checksum(cache, blocks, n)
            elif cmd == "untouched":
                (used,) = args
                out = untouched_except(cache, used)
            elif cmd == "pairs":  # peer -> what its channels' current groups are: "shm", "gloo" or None
                kinds = {}
                for side, table in (("send", ep._send), ("recv", ep._recv)):
                    for peer, ch in table.items():
                        g = ch.group
                        kinds[f"{side}:{peer}"] = None if g is None else "cuda-ipc" if getattr(g, "cuda_ipc", False) \
                            else (("shm+pull" if g.pull else "shm") if getattr(g, "shared", False) else "gloo")
                        if side == "recv" and getattr(g, "shared", False):
                            kinds[f"{side}:{peer}:counts"] = dict(g.counts)
                out = kinds
            elif cmd == "stats":
                out = [(s.request_id, s.state.value, s.num_bytes, s.seconds, s.link) for s in ep.take_completed()]
            else:
                raise ValueError(f"unknown command {cmd}")
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001 - report to the test instead of dying
            conn.send(("error", repr(e)))


class Agent:
    """Parent-side handle of an agent process."""

    def __init__(self, name: str, store_url: str, spec: CacheSpec, timeout_s: float = 5.0,
                 chunk_bytes: int = 1 << 20, shm: bool = True, shm_dir: str | None = None, no_pull: bool = False,
                 shm_full: bool = False):
        # forkserver: torch is imported once by the server, then each agent is a cheap fork of a
        # process that never started a thread pool or a process group (unlike forking the test process)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "kvtransfer", "tests.kvtransfer.agent"])
        self.name = name
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child, name, store_url, spec, timeout_s, chunk_bytes, shm,
                                                    shm_dir, no_pull, shm_full), daemon=True)
        self.proc.start()
        child.close()

    def ready(self, timeout_s: float = 60.0) -> "Agent":
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"agent {self.name} did not start")
        tag, self.pid = self.conn.recv()
        assert tag == "ready"
        return self

    def call(self, *cmd, timeout_s: float = 30.0):
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"agent {self.name}: no answer to {cmd[0]} in {timeout_s} s")
        reply = self.conn.recv()
        if reply[0] != "ok":
            raise RuntimeError(f"agent {self.name}: {cmd[0]} failed: {reply[1]}")
        return reply[1] if len(reply) > 1 else None

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        """Graceful stop if alive, else reap; never leaves the process behind."""
        try:
            if self.proc.is_alive():
                self.call("stop", timeout_s=10)
        except Exception:  # noqa: BLE001 - fall through to the kill
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()


def wait_state(agent: Agent, key: str, timeout_s: float) -> tuple[str, str | None, float]:
    """Block in the agent until the transfer ends; returns (state, failure, seconds waited)."""
    t0 = time.monotonic()
    state, failure = agent.call("wait", key, timeout_s, timeout_s=timeout_s + 30)
    return state, failure, time.monotonic() - t0
