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
the step messages; ``block_manager.take_events()`` returns them in order.

**The prefill and decode roles** (``RemoteEngine(cfg, name, kv=True)``): their KV transfers read and write the
engine's cache, so the child allocates it in shared memory (``EngineConfig.kv_cache_shared``, a memfd segment: CPU
only) and its ``ready`` message says where (the segment's handle, each layer's K and V offsets); the proxy maps it
(``SharedSegment.attach``) as ``kv_caches``, the same bytes the child's model reads and writes. The segment stays
registered under the child's handle, so a same-host peer pulls a prefill's KV straight from the child's memory.
The rest of ``engine.client.KVEngine``:

- the engine's answers the worker needs at once (``has_request``, ``check_request``, ``reserve_prompt``,
  ``cached_prefix_tokens``, ``commit_reserved``, ``get_block_table``) are calls: sent in order with the other
  commands and answered between two steps (a call waits for the step in flight; after answering, the child waits
  up to ``_FOLLOW_UP_S`` for the caller's next command before it steps, so a Reserve's two calls cost one step, not
  two). A ``ValueError`` comes back as itself; messages that arrive meanwhile are kept for ``step()``, in order.
- ``add_prefilled_request`` and ``release`` are sent as ``add_request`` is (a refused one goes to ``on_error``).
- **per-layer completion**: the child sends a ``layer`` message from inside its forward as each layer of the
  prompts whose prefill completes is in the cache (with their block tables at layer 0), and ``step()`` hands them to
  ``layer_done_callback(layer, request_ids)`` as soon as they arrive: a prefill worker's send of layer ``i`` overlaps
  the child's compute of layer ``i + 1``, as it does in process. ``get_block_table`` of those requests is answered
  from the tables that came with layer 0.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

if TYPE_CHECKING:
    from engine.client import EngineLoad, StepResult

log = logging.getLogger(__name__)

_READY_TIMEOUT_S = 600.0  # building an engine compiles kernels on a fresh machine (minutes)
_FOLLOW_UP_S = 0.002
"""After answering a call, how long the child waits for the caller's next command before it steps."""
_CALLS = frozenset({"has_request", "check_request", "get_block_table", "reserve_prompt", "cached_prefix_tokens",
                    "commit_reserved", "add_lora", "remove_lora", "lora_adapters", "lora_event_ids",
                    "reset_prefix_cache"})
"""The engine methods a proxy calls and waits for (module docstring): the KV roles' and, for every role, the LoRA
adapters' (loaded and unloaded at run time)."""
_ANY_ROLE = frozenset({"add_lora", "remove_lora", "lora_adapters", "lora_event_ids", "reset_prefix_cache"})


_EOF = object()


class _Commands:
    """The child's side of the pipe's command direction: a thread of its own reads the parent's commands as they
    come, so a parent sending (a whole prompt, say) never waits on a child that is itself blocked sending a large
    step message: each direction of the pipe is a bounded buffer, and two blocked senders would wait forever."""

    def __init__(self, conn: Connection) -> None:
        self._q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        threading.Thread(target=self._read, args=(conn,), name="engine-commands", daemon=True).start()

    def _read(self, conn: Connection) -> None:
        try:
            while True:
                self._q.put(conn.recv())
        except (EOFError, OSError):
            self._q.put(_EOF)  # the worker process went away

    def get(self, timeout_s: Optional[float]) -> Optional[tuple]:
        """The next command, waiting up to ``timeout_s`` (None: until one comes; 0: not at all); None if none came.
        EOFError once the parent's end is closed."""
        try:
            msg = self._q.get(timeout=timeout_s) if timeout_s != 0 else self._q.get_nowait()
        except queue.Empty:
            return None
        if msg is _EOF:
            raise EOFError
        return msg


def _engine_main(cfg: Any, conn: Connection, kv: bool = False) -> None:
    """The child: build the engine, then run commands and steps until ``stop`` or the parent's pipe closes."""
    try:
        from engine.llm_engine import LLMEngine

        eng = LLMEngine(cfg)
        layout = _cache_layout(eng) if kv else None
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    started: dict[str, float] = {}

    def on_layer(layer: int, request_ids: list[str]) -> None:
        if layer == 0:
            now = time.monotonic()
            for rid in request_ids:
                started.setdefault(rid, now)

    def on_layer_kv(layer: int, request_ids: list[str]) -> None:
        # from inside the forward: this layer's K/V of these prompts is in the shared cache now
        tables = {rid: eng.get_block_table(rid) for rid in request_ids} if layer == 0 else None
        conn.send(("layer", layer, list(request_ids), tables))

    eng.layer_done_callback = on_layer_kv if kv else on_layer
    conn.send(("ready", {"num_total_blocks": eng.num_total_blocks, "block_size": eng.block_size,
                         "kv_cache_dtype": eng.kv_cache_dtype, "max_model_len": eng.max_model_len,
                         "enable_caching": eng.block_manager.enable_caching, "kv_cache": layout}, _snapshot(eng)))
    errors: list[tuple[str, str]] = []
    seen = 0  # commands run so far: each message says it, so the parent knows its commands took effect
    cmds = _Commands(conn)
    try:
        while True:  # an engine exception goes to the worker as ("failed", traceback), below
            busy = eng.has_unfinished_requests()
            ran = 0
            replied = False
            # the commands waiting now; idle, block until one comes (the parent's death is EOF)
            while (msg := cmds.get(_FOLLOW_UP_S if replied else 0 if busy or errors or ran else None)) is not None:
                ran += 1
                seen += 1
                replied = False
                op = msg[0]
                if op == "add":
                    _, rid, ids, params, kw = msg
                    try:
                        eng.add_request(rid, ids, params, **kw)
                    except Exception as e:  # that request's, not the engine's: the others go on
                        errors.append((rid, _refusal(e)))
                elif op == "prefilled":
                    _, rid, ids, first, params, first_logprob = msg
                    try:
                        eng.add_prefilled_request(rid, ids, first, params, first_logprob=first_logprob)
                    except Exception as e:
                        errors.append((rid, _refusal(e)))
                elif op == "abort":
                    eng.abort_request(msg[1])
                    started.pop(msg[1], None)
                elif op == "release":
                    eng.release(msg[1])
                elif op == "call":
                    _, name, args, kw = msg
                    if name not in _CALLS:
                        raise RuntimeError(f"engine process call of {name!r}: not an engine call")
                    try:
                        reply = ("reply", True, getattr(eng, name)(*args, **kw))
                    except Exception as e:  # the caller's, as itself: the engine's ValueError names the field
                        reply = ("reply", False, _portable(e))
                    conn.send((*reply, _snapshot(eng), seen))
                    replied = True
                elif op == "events":
                    eng.block_manager.enable_events()
                elif op == "stop":
                    return
                else:  # a protocol error is a bug: end loudly (the worker gets the traceback)
                    raise RuntimeError(f"unknown engine process command {op!r}")
                busy = eng.has_unfinished_requests()
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


def _cache_layout(eng: Any) -> dict:
    """Where the child's KV cache lies, for the proxy to map (``{"why": ...}`` when it is not in one segment)."""
    from transport.shared_memory import segment_of

    k0 = eng.kv_caches[0][0]
    seg = segment_of(k0)
    if seg is None:
        return {"why": "the engine's KV cache is in private memory (see the engine process's log)"}
    offsets = []
    for k, v in eng.kv_caches:
        if not (seg.contains(k) and seg.contains(v)):
            return {"why": "the engine's KV cache spans more than one shared segment"}
        offsets.append((seg.offset(k), seg.offset(v)))
    return {"handle": seg.handle, "offsets": offsets, "shape": tuple(k0.shape), "dtype": k0.dtype}


def _refusal(e: Exception) -> str:
    """What a refused add tells the worker: the engine's ValueError names the field; anything else is named too."""
    return str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


def _portable(e: Exception) -> Exception:
    """``e`` if it survives pickling (the parent raises it as itself), else a RuntimeError saying what it was."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(e).__name__}: {e}")


class RemoteEngine:
    """The worker-side proxy of an engine in its own process (see module docstring). Loop thread only, except
    ``wake`` and the snapshot attributes. ``kv``: the prefill and decode roles' engine, its KV cache shared."""

    def __init__(self, cfg: Any, name: str = "engine", kv: bool = False) -> None:
        if kv and not getattr(cfg, "kv_cache_shared", False):
            cfg = dataclasses.replace(cfg, kv_cache_shared=True)  # (EngineConfig refuses it off CPU, naming it)
        self.cfg = cfg
        self.name = name
        self.kv = kv
        self.kv_caches: list = []
        """(``kv``) Per layer, the (k, v) views of the child's cache this process maps."""
        self.layer_done_callback: Optional[Callable[..., None]] = None
        """Called as ``(0, request_ids, at)`` when those prompts' first layer ran (``at``: monotonic time); with
        ``kv``, as ``(layer, request_ids)`` as each layer of them is in the cache (module docstring)."""
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
        self._pending: deque = deque()  # messages that came while a call waited for its reply, for step()
        self._held: set[str] = set()  # (kv) ids with blocks in the child the worker frees: reserved, added
        self._tables: dict[str, list[int]] = {}  # (kv) block tables that came with a prompt's layer 0
        self.block_manager = _RemoteBlocks(self)
        """The prefix cache's side the worker uses: ``enable_caching``, ``enable_events()``, ``take_events()``."""

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "RemoteEngine":
        if mp.current_process().daemon:
            raise RuntimeError(f"{self.name}: engine_process needs a worker process that may have children; this "
                               "one is a daemonic multiprocessing process")
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_engine_main, args=(self.cfg, child, self.kv), name=f"{self.name}-core",
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
        if self.kv:
            try:
                self.kv_caches = _map_cache(self._facts["kv_cache"])
            except (OSError, ValueError) as e:
                self.shutdown()
                raise RuntimeError(f"{self.name}: the engine process's KV cache cannot be mapped here ({e}); the "
                                   "prefill and decode roles need it in shared memory") from e
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
        if self.kv:  # a prefill's blocks outlive its output, until the worker releases them
            self._held.add(request_id)

    def _send(self, msg: tuple) -> None:
        if self._conn is None:
            raise RuntimeError(f"{self.name}: the engine process is stopped")
        try:
            self._conn.send(msg)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"{self.name}: the engine process is gone ({e})") from e
        self._sent += 1

    def abort_request(self, request_id: str) -> None:
        if request_id in self._live or request_id in self._held:
            self._live.discard(request_id)
            self._held.discard(request_id)
            self._tables.pop(request_id, None)
            self._send(("abort", request_id))

    # ---- the KV roles' side (``engine.client.KVEngine``; ``kv`` only) ----------------------------------
    # (no ``owner_lock``: the child's forward cannot let go of this process's lock, so ``EngineLoop.beside`` runs
    # as ``call`` for this engine and the pipe is used by the loop thread alone)

    def has_request(self, request_id: str) -> bool:
        return bool(self._call("has_request", request_id))

    def check_request(self, request_id: str, prompt_token_ids: list[int], params: Any, *,
                      prefill_only: bool = False) -> None:
        self._call("check_request", request_id, list(prompt_token_ids), params, prefill_only=prefill_only)

    def get_block_table(self, request_id: str) -> list[int]:
        table = self._tables.get(request_id)
        return list(table) if table is not None else self._call("get_block_table", request_id)

    def reserve_prompt(self, request_id: str, num_tokens: int, prompt_token_ids: Optional[list[int]] = None, *,
                       prefix: bool = False, lora_name: Optional[str] = None,
                       cache_salt: Optional[str] = None) -> Optional[tuple[list[int], int]]:
        ids = None if prompt_token_ids is None else list(prompt_token_ids)
        got = self._call("reserve_prompt", request_id, num_tokens, ids, prefix=prefix, lora_name=lora_name,
                         cache_salt=cache_salt)
        if got is not None:
            self._held.add(request_id)
        return got

    def cached_prefix_tokens(self, prompt_token_ids: list[int], lora_name: Optional[str] = None,
                             cache_salt: Optional[str] = None) -> int:
        return int(self._call("cached_prefix_tokens", list(prompt_token_ids), lora_name=lora_name,
                              cache_salt=cache_salt))

    def commit_reserved(self, request_id: str, prompt_token_ids: list[int]) -> int:
        return int(self._call("commit_reserved", request_id, list(prompt_token_ids)))

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], first_token_id: int, params: Any,
                              first_logprob: Any = None) -> None:
        """Sent, not waited for: a refusal (the engine's ValueError) goes to ``on_error``, as an add's does."""
        self._require_kv()
        self._send(("prefilled", request_id, list(prompt_token_ids), first_token_id, params, first_logprob))
        self._live.add(request_id)
        self._held.add(request_id)

    def release(self, request_id: str) -> None:
        self._tables.pop(request_id, None)
        if request_id in self._held:
            self._held.discard(request_id)
            self._live.discard(request_id)
            self._send(("release", request_id))

    def add_lora(self, name: str, path: str) -> int:
        return int(self._call("add_lora", name, path))

    def remove_lora(self, name: str) -> int:
        return int(self._call("remove_lora", name))

    def lora_adapters(self) -> dict[str, int]:
        return dict(self._call("lora_adapters"))

    def lora_event_ids(self) -> dict[int, int]:
        return dict(self._call("lora_event_ids"))

    def reset_prefix_cache(self) -> tuple[bool, int]:
        ok, held = self._call("reset_prefix_cache")
        return bool(ok), int(held)

    def _require_kv(self) -> None:
        if not self.kv:
            raise RuntimeError(f"{self.name}: the engine process was started without its KV cache shared "
                               "(RemoteEngine(kv=True) is the prefill and decode roles' engine)")

    def _call(self, name: str, *args: Any, **kw: Any) -> Any:
        """Run ``engine.<name>(*args, **kw)`` in the child and return its answer (raise its exception); what comes
        meanwhile waits in ``_pending`` for ``step()``."""
        if name not in _ANY_ROLE:
            self._require_kv()
        self._send(("call", name, args, kw))
        conn = self._conn
        assert conn is not None
        try:
            while True:
                if not conn.poll(1.0):
                    if self._proc is not None and not self._proc.is_alive():
                        raise EOFError
                    continue
                msg = conn.recv()
                if msg[0] == "reply":
                    _, ok, value, snap, seen = msg
                    self._note(snap, seen)
                    if ok:
                        return value
                    raise value
                if msg[0] == "failed":
                    raise RuntimeError(f"{self.name}: the engine process failed:\n{msg[1]}")
                self._pending.append(msg)
        except (EOFError, OSError) as e:
            code = self._proc.exitcode if self._proc is not None else None
            raise RuntimeError(f"{self.name}: the engine process died (exit code {code})") from e

    def _note(self, snap: tuple, seen: int) -> None:
        """A message's load snapshot, unless a later one (a call's reply, read ahead of messages kept for
        ``step()``) is already here."""
        if seen >= self._seen:
            self._snap, self._seen = snap, seen

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or commands whose effect (freed blocks, a refusal) has not come back yet. Raises
        once the engine process has died: the worker's loop asks this on every pass, idle or not, so a child
        killed while the worker is idle ends the loop (the worker reports not ready and is replaced) instead of
        failing each later request with a broken pipe."""
        proc = self._proc
        if proc is not None and self._conn is not None and not proc.is_alive():
            why = ""
            try:  # a child that failed sent its traceback first: name the cause, not only the exit
                while self._conn.poll(0):
                    msg = self._conn.recv()
                    if msg[0] == "failed":
                        why = f":\n{msg[1]}"
            except (EOFError, OSError):
                pass
            raise RuntimeError(f"{self.name}: the engine process exited (exit code {proc.exitcode}){why}")
        return bool(self._live) or self._seen < self._sent or bool(self._pending)

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
        ready = wait([conn, self._wake_r], 0 if self._pending else timeout_s)
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 65536):
                    pass
            except BlockingIOError:
                pass
        outs: list = []
        try:
            for msg in self._messages(conn):
                self._take(msg, outs)
        except (EOFError, OSError) as e:
            code = self._proc.exitcode if self._proc is not None else None
            raise RuntimeError(f"{self.name}: the engine process died (exit code {code})") from e
        return outs

    def _messages(self, conn: Connection) -> Iterator[tuple]:
        """Kept messages first, then the pipe's, in order (a callback's call may keep more: they come next)."""
        while True:
            if self._pending:
                yield self._pending.popleft()
            elif conn.poll(0):
                yield conn.recv()
            else:
                return

    def _take(self, msg: tuple, outs: list) -> None:
        op = msg[0]
        if op == "failed":
            raise RuntimeError(f"{self.name}: the engine process failed:\n{msg[1]}")
        if op == "layer":
            _, layer, ids, tables = msg
            if tables:  # (not for a request the worker let go meanwhile: nothing would remove it)
                self._tables.update((r, t) for r, t in tables.items() if r in self._live or r in self._held)
            if self.layer_done_callback is not None:
                self.layer_done_callback(layer, ids)
            return
        if op != "step":
            raise RuntimeError(f"{self.name}: unexpected message {op!r} from the engine process")
        _, step_outs, started, errors, snap, seen, events = msg
        self._note(snap, seen)
        if events:
            self.block_manager.events.extend(events)
        if started and self.layer_done_callback is not None:
            for rid, at in started.items():
                self.layer_done_callback(0, [rid], at)
        for rid, text in errors:
            if rid in self._live:
                self._live.discard(rid)
                self.on_error(rid, text)
        for o in step_outs:
            if o.finish_reason:
                self._live.discard(o.request_id)
                if o.finish_reason != "prefill_done":  # a prefill's blocks stay until its KV is sent (release)
                    self._held.discard(o.request_id)
                    self._tables.pop(o.request_id, None)
        outs.extend(step_outs)

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

    def load(self) -> "EngineLoad":
        """The latest snapshot the child sent (after its last step or the last call it answered)."""
        from engine.client import EngineLoad

        free, running, waiting, stats = self._snap
        return EngineLoad(int(free), self.num_total_blocks, int(running), int(waiting), stats)

    def step_result(self, timeout_s: float = 0.05) -> "StepResult":
        """``step()``'s outputs with the load and prefix-cache events that came with them."""
        from engine.client import StepResult

        outs = self.step(timeout_s)
        return StepResult(outs, self.load(), self.block_manager.take_events())


def _map_cache(layout: Optional[dict]) -> list:
    """The child's per-layer (k, v) cache as views of its segment mapped here (``_cache_layout``'s record)."""
    from transport.shared_memory import SharedSegment

    if not layout or "handle" not in layout:
        raise ValueError((layout or {}).get("why", "the engine process sent no cache layout"))
    seg = SharedSegment.attach(layout["handle"])
    shape, dtype = tuple(layout["shape"]), layout["dtype"]
    return [(seg.view(k, shape, dtype), seg.view(v, shape, dtype)) for k, v in layout["offsets"]]


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
