"""The engine core in a process of its own (``WorkerConfig.engine_process``), vLLM v1's split.

Why: in one worker process the engine's steps share one GIL (and, pinned, one core) with the gRPC servicer
threads, the output streams and the per-token routing. Here the engine steps in a child process, while the
worker process keeps everything else. Measured on 27 Nov (docs/benchmarks.md, "The engine core in its own
process"): at parity with the in-process engine on a 2-core host and in one H100 run, where the engine's own
CPU per step (kernel launches), not the serving work, filled its core. It pays where the worker's serving work
is what keeps the engine's core busy and the host has a core for it.

Lifecycle: ``RemoteEngine(cfg).start()`` spawns ``_engine_main`` (a ``multiprocessing`` spawn child), which
builds the ``LLMEngine`` and answers one ``ready`` message with the engine's fixed facts; a load failure
comes back as a RuntimeError with the child's traceback. From then on the worker's ``EngineLoop`` thread
uses the proxy as it would the engine:

- ``add_request`` / ``abort_request`` are sent at once (fire and forget, in order on one pipe). An add the
  engine refuses (its ``ValueError``) comes back in a later step message and goes to ``on_error(request_id,
  message)``, which the worker turns into INVALID_ARGUMENT on that request's stream.
- ``step()`` waits for the child's next message(s), or for ``wake()`` (the loop has a command to run), and
  returns their outputs in order. One message per engine step: its outputs for every request, the requests
  whose prompts started running (``layer_done_callback(0, ids, at)``: the queue time's end, stamped in the
  child on the shared monotonic clock), refused adds, and the load snapshot (blocks, running, waiting,
  ``make_stats()``), which the proxy's attributes then report.
- ``has_unfinished_requests()`` is the proxy's own count: added, not yet finished, aborted or refused, or
  commands the child has not acknowledged yet (each message carries how many it ran, so an abort's freed
  blocks reach the snapshot before the loop goes idle).
- ``shutdown()`` asks the child to stop and joins it (killed after a grace period). The child also exits
  when the worker process dies: its pipe reads EOF. If the child dies, ``step()`` raises, so the loop dies
  as it would on an engine exception: the worker reports not ready and fails its requests.

CPU placement: the child inherits the worker's CPU affinity; the OS places both processes. ``benchmarks/harness/deployment.py`` pins every thread of each to a core of its own.
The prefix cache's KV events (``block_manager.enable_events()``) are recorded in the child and travel in
the step messages; ``block_manager.take_events()`` returns them in order. What runs only in-process for now:
KV transfer (decode and prefill roles write received KV into the cache tensors); ``WorkerConfig`` refuses it.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

_READY_TIMEOUT_S = 600.0  # building an engine compiles kernels on a fresh machine (minutes)


def _engine_main(cfg: Any, conn: Connection) -> None:
    """The child: build the engine, then run commands and steps until ``stop`` or the parent's pipe closes."""
    try:
        from engine.llm_engine import LLMEngine

        eng = LLMEngine(cfg)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    started: dict[str, float] = {}

    def on_layer(layer: int, request_ids: list[str]) -> None:
        if layer == 0:
            now = time.monotonic()
            for rid in request_ids:
                started.setdefault(rid, now)

    eng.layer_done_callback = on_layer
    conn.send(("ready", {"num_total_blocks": eng.num_total_blocks, "block_size": eng.block_size,
                         "kv_cache_dtype": eng.kv_cache_dtype, "max_model_len": eng.max_model_len,
                         "enable_caching": eng.block_manager.enable_caching}, _snapshot(eng)))
    errors: list[tuple[str, str]] = []
    seen = 0  # commands run so far: each message says it, so the parent knows its commands took effect
    try:
        while True:  # an engine exception goes to the worker as ("failed", traceback), below
            busy = eng.has_unfinished_requests()
            ran = 0
            # the commands waiting now; idle, block until one comes (the parent's death is EOF)
            while conn.poll(0 if busy or errors or ran else None):
                msg = conn.recv()
                ran += 1
                op = msg[0]
                if op == "add":
                    _, rid, ids, params, kw = msg
                    try:
                        eng.add_request(rid, ids, params, **kw)
                    except ValueError as e:
                        errors.append((rid, str(e)))
                elif op == "abort":
                    eng.abort_request(msg[1])
                    started.pop(msg[1], None)
                elif op == "events":
                    eng.block_manager.enable_events()
                elif op == "stop":
                    return
                else:  # a protocol error is a bug: end loudly (the worker gets the traceback)
                    raise RuntimeError(f"unknown engine process command {op!r}")
                busy = eng.has_unfinished_requests()
            seen += ran
            outs = eng.step() if busy else []
            events = eng.block_manager.take_events()
            if outs or errors or started or ran or events:
                conn.send(("step", outs, started, errors, _snapshot(eng), seen, events))
                started, errors = {}, []
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the worker process went away
    except BaseException:
        try:
            conn.send(("failed", traceback.format_exc()))
        except (OSError, ValueError):
            pass
        raise


def _snapshot(eng: Any) -> tuple:
    return (eng.num_free_blocks, eng.num_running, eng.num_waiting, eng.make_stats())


class RemoteEngine:
    """The worker-side proxy of an engine in its own process (see module docstring). Loop thread only, except
    ``wake`` and the snapshot attributes."""

    def __init__(self, cfg: Any, name: str = "engine") -> None:
        self.cfg = cfg
        self.name = name
        self.layer_done_callback: Optional[Callable[..., None]] = None
        """Called as ``(0, request_ids, at)`` when those prompts' first layer ran (``at``: monotonic time)."""
        self.on_error: Callable[[str, str], None] = lambda rid, msg: log.warning("%s: request %s refused: %s",
                                                                               name, rid, msg)
        self._conn: Optional[Connection] = None
        self._proc: Any = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe already wakes the loop: never block a caller
        self._live: set[str] = set()
        self._sent = 0  # commands sent; the child's messages say how many it ran
        self._seen = 0
        self._facts: dict = {}
        self._snap: tuple = (0, 0, 0, None)
        self.block_manager = _RemoteBlocks(self)
        """The prefix cache's side the worker uses: ``enable_caching``, ``enable_events()``, ``take_events()``."""

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "RemoteEngine":
        if mp.current_process().daemon:
            raise RuntimeError(f"{self.name}: engine_process needs a worker process that may have children; this "
                               "one is a daemonic multiprocessing process")
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_engine_main, args=(self.cfg, child), name=f"{self.name}-core",
                                 daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(_READY_TIMEOUT_S):
            self.shutdown()
            raise RuntimeError(f"{self.name}: the engine process did not start in {_READY_TIMEOUT_S:.0f} s")
        try:
            msg = parent.recv()
        except EOFError:
            self.shutdown()
            raise RuntimeError(f"{self.name}: the engine process exited while loading "
                               f"(exit code {self._proc.exitcode})") from None
        if msg[0] != "ready":
            self.shutdown()
            raise RuntimeError(f"{self.name}: the engine process failed to load:\n{msg[1]}")
        self._facts, self._snap = msg[1], msg[2]
        return self

    @property
    def pid(self) -> Optional[int]:
        """The engine process's pid (None before ``start``)."""
        return self._proc.pid if self._proc is not None else None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine process (idempotent)."""
        if self._proc is None:
            return
        if self._conn is not None:
            try:
                self._conn.send(("stop",))
            except (OSError, ValueError):
                pass
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout_s)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    # ---- the engine's interface, as the worker uses it ----------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any, **kw: Any) -> None:
        self._send(("add", request_id, list(prompt_token_ids), params, kw))
        self._live.add(request_id)

    def _send(self, msg: tuple) -> None:
        if self._conn is None:
            raise RuntimeError(f"{self.name}: the engine process is stopped")
        try:
            self._conn.send(msg)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"{self.name}: the engine process is gone ({e})") from e
        self._sent += 1

    def abort_request(self, request_id: str) -> None:
        if request_id in self._live:
            self._live.discard(request_id)
            self._send(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or commands whose effect (freed blocks, a refusal) has not come back yet. Raises
        once the engine process has died: the worker's loop asks this on every pass, idle or not, so a child
        killed while the worker is idle ends the loop (the worker reports not ready and is replaced) instead of
        failing each later request with a broken pipe."""
        proc = self._proc
        if proc is not None and self._conn is not None and not proc.is_alive():
            raise RuntimeError(f"{self.name}: the engine process exited (exit code {proc.exitcode})")
        return bool(self._live) or self._seen < self._sent

    def wake(self) -> None:
        """Any thread: end a ``step()`` that waits (the loop has a command)."""
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full (the loop will wake) or closed (stopped)
            pass

    def step(self, timeout_s: float = 0.05) -> list:
        """The outputs of every step message that arrived, waiting up to ``timeout_s`` for one (or a ``wake``)."""
        conn = self._conn
        if conn is None:
            raise RuntimeError(f"{self.name}: the engine process is stopped")
        ready = wait([conn, self._wake_r], timeout_s)
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 65536):
                    pass
            except BlockingIOError:
                pass
        outs: list = []
        try:
            while conn.poll(0):
                msg = conn.recv()
                if msg[0] == "failed":
                    raise RuntimeError(f"{self.name}: the engine process failed:\n{msg[1]}")
                _, step_outs, started, errors, self._snap, self._seen, events = msg
                if events:
                    self.block_manager.events.extend(events)
                if started and self.layer_done_callback is not None:
                    for rid, at in started.items():
                        self.layer_done_callback(0, [rid], at)
                for rid, msg in errors:
                    if rid in self._live:
                        self._live.discard(rid)
                        self.on_error(rid, msg)
                for o in step_outs:
                    if o.finish_reason and o.request_id in self._live:
                        self._live.discard(o.request_id)
                outs.extend(step_outs)
        except (EOFError, OSError) as e:
            code = self._proc.exitcode if self._proc is not None else None
            raise RuntimeError(f"{self.name}: the engine process died (exit code {code})") from e
        return outs

    # ---- the load snapshot of the latest step ------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return int(self._facts["num_total_blocks"])

    @property
    def block_size(self) -> int:
        return int(self._facts["block_size"])

    @property
    def kv_cache_dtype(self) -> str:
        return str(self._facts["kv_cache_dtype"])

    @property
    def max_model_len(self) -> int:
        return int(self._facts["max_model_len"])

    @property
    def num_free_blocks(self) -> int:
        return int(self._snap[0])

    @property
    def num_running(self) -> int:
        return int(self._snap[1])

    @property
    def num_waiting(self) -> int:
        return int(self._snap[2])

    def make_stats(self) -> Any:
        return self._snap[3]


class _RemoteBlocks:
    """``RemoteEngine.block_manager``: the engine process's prefix-cache events, as ``BlockManager`` hands them."""

    def __init__(self, owner: RemoteEngine) -> None:
        self._owner = owner
        self.events: list[tuple] = []

    @property
    def enable_caching(self) -> bool:
        return bool(self._owner._facts.get("enable_caching"))

    def enable_events(self) -> None:
        self._owner._send(("events",))

    def take_events(self) -> list[tuple]:
        ev, self.events = self.events, []
        return ev
