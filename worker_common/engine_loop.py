"""One background thread that owns an engine (``engine.step()`` is not thread-safe).

Lifecycle: a worker builds ``EngineLoop(engine, name, on_outputs, poll)`` and
``start()``s it. gRPC handler threads never touch the engine: they ``call(fn)``
(run ``fn(engine)`` on the loop thread and wait for its result) or ``post(fn)``
(fire and forget). Each iteration the loop runs the queued commands, then the
role's ``poll()`` (kvtransfer progress, deadlines), ``after()``, then one ``engine.step_result()``
when there is work, handing its outputs to ``on_outputs`` (still on the loop
thread, which routes them to per-request queues or output streams), the whole result to ``on_step`` and calling
``after()`` again. ``stop()`` ends the thread;
commands still queued fail with RuntimeError so no caller waits forever.

``beside(fn)`` runs ``fn(engine)`` on the calling thread while the loop is not inside the engine: between two
passes, or while a step's model runs (the loop holds ``lock`` whenever it works, and an engine that has
``owner_lock`` lets go of it for its forward: ``LLMEngine._execute``). What a decode worker's ``Reserve`` does
(take blocks, post a KV receive, hold its record) is answered that way within milliseconds instead of after the
step in flight, which the first token waited for. While ``fn`` runs the loop thread is idle or inside the forward,
so ``fn`` may change what the loop changes only under ``lock`` (the engine's requests and free blocks, the worker's
request records), never what a forward reads (the scheduled sequences) or what the engine's layer callbacks touch.
An engine without ``owner_lock`` (one in its own process) runs ``beside`` as ``call``.
"""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from engine.outputs import CoreOutput

if TYPE_CHECKING:
    from engine.client import EngineCore, StepResult

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    """Serializes all engine access onto one thread."""

    def __init__(self, engine: EngineCore, name: str, on_outputs: Callable[[list[CoreOutput]], None],
                 poll: Optional[Callable[[], bool]] = None, idle_wait_s: float = 0.05,
                 busy_poll_s: float = 0.001, on_death: Optional[Callable[[BaseException], None]] = None,
                 after: Optional[Callable[[], None]] = None,
                 on_step: Optional[Callable[[StepResult], None]] = None) -> None:
        """``poll()`` returns True while it has pending work (then the loop waits only ``busy_poll_s``);
        ``on_death(exc)`` runs on the loop thread if an engine step (or a hook) raises; ``after()`` runs after
        each pass's commands and polls, after each step, and after a command that woke an idle loop (the
        worker's output streams send what the pass put: one message per step); ``on_step(result)`` gets each
        step's whole ``StepResult`` (its load and prefix-cache events) after ``on_outputs``."""
        self.engine = engine
        self.name = name
        self._on_outputs = on_outputs
        self._poll = poll
        self._on_death = on_death
        self._after = after or (lambda: None)
        self._on_step = on_step
        self._idle_wait_s = idle_wait_s
        self._busy_poll_s = busy_poll_s
        self._cmds: "queue.SimpleQueue[tuple[Callable[[Any], Any], Optional[Future]]]" = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # an engine in its own process (worker_common.engine_process) waits in step() for its next message:
        # a queued command ends that wait
        self._wake: Callable[[], None] = getattr(engine, "wake", None) or (lambda: None)
        self.error: Optional[BaseException] = None
        self.lock = threading.Lock()
        """Held by the loop thread while it works (commands, polls, steps but their forwards); ``beside`` takes it."""
        self._shares_forward = hasattr(engine, "owner_lock")
        if self._shares_forward:
            engine.owner_lock = self.lock

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.name}: loop already started")
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[[Any], T], timeout_s: Optional[float] = 30.0) -> T:
        """Run ``fn(engine)`` on the loop thread and return its result (or raise its exception)."""
        if self.in_loop():
            return fn(self.engine)
        if not self.alive:
            raise RuntimeError(f"{self.name}: engine loop is not running")
        fut: Future = Future()
        self._cmds.put((fn, fut))
        self._wake()
        return fut.result(timeout=timeout_s)

    def beside(self, fn: Callable[[Any], T], timeout_s: Optional[float] = 30.0) -> T:
        """Run ``fn(engine)`` on this thread while the loop thread is outside the engine or in a step's forward
        (see the module docstring); as ``call`` where the engine cannot share its forward."""
        if self.in_loop():
            return fn(self.engine)
        if not self._shares_forward:
            return self.call(fn, timeout_s)
        if not self.alive:
            raise RuntimeError(f"{self.name}: engine loop is not running")
        if not self.lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise TimeoutError(f"{self.name}: the engine stayed busy for {timeout_s} s")
        try:
            return fn(self.engine)
        finally:
            self.lock.release()

    def post(self, fn: Callable[[Any], Any]) -> None:
        """Queue ``fn(engine)`` for the loop thread without waiting."""
        if self.in_loop():
            fn(self.engine)
            return
        self._cmds.put((fn, None))
        self._wake()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._cmds.put((lambda _e: None, None))  # wake the loop
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._fail_pending()
        if self._shares_forward and not self.alive and self.engine.owner_lock is self.lock:
            self.engine.owner_lock = None  # whoever steps the engine next does not hold this lock

    def _fail_pending(self) -> None:
        while True:
            try:
                _fn, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError(f"{self.name}: engine loop stopped"))

    def _run_cmd(self, fn: Callable[[Any], Any], fut: Optional[Future]) -> None:
        try:
            res = fn(self.engine)
        except BaseException as e:  # the caller gets it; the loop carries on
            if fut is not None:
                fut.set_exception(e)
            else:
                log.exception("%s: posted command failed", self.name)
            return
        if fut is not None:
            fut.set_result(res)

    def _pass(self) -> Optional[bool]:
        """One pass (under ``lock``): queued commands, polls, one step when there is work. None if it stepped,
        else whether the poll has pending work (how long the idle wait may be)."""
        while True:
            try:
                fn, fut = self._cmds.get_nowait()
            except queue.Empty:
                break
            self._run_cmd(fn, fut)
        busy = bool(self._poll()) if self._poll is not None else False
        self._after()
        if self.engine.has_unfinished_requests():
            res = self.engine.step_result()
            if res.outputs:
                self._on_outputs(res.outputs)
            if self._on_step is not None:
                self._on_step(res)
            if res.outputs:
                self._after()
            return None
        return busy

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self.lock:
                    busy = self._pass()
                if busy is None:
                    continue
                # idle: sleep on the command queue so a new request wakes us at once
                try:
                    fn, fut = self._cmds.get(timeout=self._busy_poll_s if busy else self._idle_wait_s)
                except queue.Empty:
                    continue
                with self.lock:
                    self._run_cmd(fn, fut)
                    self._after()
        except BaseException as e:
            self.error = e
            log.exception("%s: engine loop died", self.name)
            if self._on_death is not None:
                self._on_death(e)
        finally:
            self._stop.set()
            self._fail_pending()
