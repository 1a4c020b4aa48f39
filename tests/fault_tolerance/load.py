"""Trace-driven load for the fault tests: a slice of the conversation trace replayed through the router.

Lifecycle: ``trace_requests(start, n)`` turns rows ``start .. start+n`` of the test trace
(``tests/data``) into ``TraceRequest``s: lengths scaled to the tiny model (prompts ~20-120
tokens, outputs ~8-32), arrivals compressed to a stated mean rate, prompts as token ids made
deterministically from the row's lengths (so the offline reference sees the very same ids).
``Replay(address, requests).start()`` paces the arrivals on its own thread and sends each
request from a thread pool of gRPC clients (greedy, ``ignore_eos``, one deadline each); the
test thread meanwhile waits for the fault moment (``wait_for(submitted=, streaming=)``),
injects the fault, watches the cluster heal, then ``join()``s the ``Result``s. ``send`` runs
one request the same way (the retries after the fault). ``Result.code`` is the gRPC status
name, with ``ROUTER_FAILURE`` for an UNAVAILABLE the router answers only when it caught an
exception of its own (a bug masked as a retriable code) and ``EXCEPTION:<type>`` for anything
that is not a gRPC status at all.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import grpc

from loadtest.trace import load_trace, scale_trace
from proto import pdserve_pb2, pdserve_pb2_grpc

HEAL_DEADLINE_S = 30.0
"""The bound on a pool's healing on the tiny model, where workers start as fast as on an idle machine."""
HEAL_START_RATIO = 2.5
"""... or this many times the test cluster's own measured start, where that is slower (beside two CPU hogs a
replacement took 30-80 s on 29 Nov): a replacement starts a worker as the cluster's start did."""


def heal_deadline_s(start_s: float) -> float:
    """How long a SIGKILLed worker's pool may take to heal, for a cluster that took ``start_s`` to start."""
    return max(HEAL_DEADLINE_S, HEAL_START_RATIO * start_s)

TRACE = Path(__file__).resolve().parents[1] / "data" / "azure_llm_2023_conv_first400.csv"
PROMPT_SCALE, PROMPT_RANGE = 0.08, (20, 120)   # 91 -> 20 (floor), 374 -> 30, 1313 -> 105, 2221+ -> 120 (cap)
OUTPUT_SCALE, OUTPUT_RANGE = 0.15, (8, 32)     # 44 -> 8 (floor), 109 -> 16, 152 -> 23, 217 -> 32 (cap)
FIRST_ID, NUM_IDS = 3, 8000                    # prompt ids stay clear of the tiny vocab's specials (0-2)
ROUTER_FAILURE = "ROUTER_FAILURE"
_ROUTER_FAILURE_TEXT = "the router failed to serve it"


@dataclass(frozen=True)
class TraceRequest:
    """One request of the replay."""

    index: int
    """Position in the replay (0-based)."""
    arrival_s: float
    """Seconds after the replay starts."""
    token_ids: tuple[int, ...]
    max_tokens: int


def _clamp(n: int, lo_hi: tuple[int, int]) -> int:
    return max(lo_hi[0], min(lo_hi[1], n))


def prompt_ids(row: int, length: int) -> tuple[int, ...]:
    """Deterministic prompt ids for trace row ``row`` of ``length`` tokens (no shared prefixes between rows)."""
    return tuple(FIRST_ID + (row * 7919 + j * 104729 + length * 31) % NUM_IDS for j in range(length))


def trace_requests(start: int, n: int, rate_per_s: float) -> list[TraceRequest]:
    """Rows ``start .. start+n`` of the test trace, scaled to the tiny model, arriving ``rate_per_s`` per second
    on average (the trace's own gaps, compressed)."""
    rows = load_trace(TRACE, start, n)
    span = rows[-1].arrival_s
    time_scale = ((n - 1) / rate_per_s) / span if span > 0 else 0.0
    prompts = scale_trace(rows, PROMPT_SCALE, time_scale)
    outputs = scale_trace(rows, OUTPUT_SCALE)
    return [TraceRequest(index=i, arrival_s=p.arrival_s,
                         token_ids=prompt_ids(start + i, _clamp(p.prompt_len, PROMPT_RANGE)),
                         max_tokens=_clamp(o.output_len, OUTPUT_RANGE))
            for i, (p, o) in enumerate(zip(prompts, outputs))]


@dataclass
class Result:
    """How one request ended."""

    index: int
    code: str
    """"OK", a gRPC status name, ROUTER_FAILURE or EXCEPTION:<type>."""
    token_ids: list[int] = field(default_factory=list)
    details: str = ""
    finish_reason: str = ""
    seconds: float = 0.0


def counts(results: Sequence[Result]) -> dict[str, int]:
    """Requests by status code."""
    return dict(sorted(Counter(r.code for r in results).items()))


class Replay:
    """Replays requests through one router address (see module docstring)."""

    def __init__(self, address: str, requests: Sequence[TraceRequest], timeout_s: float = 60.0) -> None:
        self.address = address
        self.requests = list(requests)
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address)
        self._stub = pdserve_pb2_grpc.PDServeStub(self._channel)
        self._pool = cf.ThreadPoolExecutor(max_workers=max(1, len(self.requests)), thread_name_prefix="replay")
        self._futures: list[cf.Future] = []
        self._cond = threading.Condition()
        self._submitted = 0
        self._streaming = 0  # requests that have their first token and are not finished
        self._pacer: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # ---- one request -------------------------------------------------------------------------------
    def send(self, req: TraceRequest) -> Result:
        """One greedy streamed Generate of ``req``; never raises."""
        msg = pdserve_pb2.GenerateRequest(request_id=f"trace-{req.index}-{time.monotonic_ns()}",
                                          token_ids=list(req.token_ids), max_tokens=req.max_tokens,
                                          temperature=0.0, ignore_eos=True)
        t0 = time.monotonic()
        toks: list[int] = []
        finish = ""
        streaming = False
        try:
            for resp in self._stub.Generate(msg, timeout=self.timeout_s):
                if resp.token_ids and not streaming:
                    streaming = True
                    with self._cond:
                        self._streaming += 1
                        self._cond.notify_all()
                toks.extend(resp.token_ids)
                finish = resp.finish_reason or finish
            return Result(req.index, "OK", toks, "", finish, time.monotonic() - t0)
        except grpc.RpcError as e:
            code, details = e.code().name, e.details() or ""
            if code == "UNAVAILABLE" and _ROUTER_FAILURE_TEXT in details:
                code = ROUTER_FAILURE
            return Result(req.index, code, toks, details, finish, time.monotonic() - t0)
        except Exception as e:  # not a gRPC status: the test reports it as a code of its own
            return Result(req.index, f"EXCEPTION:{type(e).__name__}", toks, str(e), finish, time.monotonic() - t0)
        finally:
            if streaming:
                with self._cond:
                    self._streaming -= 1
                    self._cond.notify_all()

    def send_all(self, reqs: Sequence[TraceRequest]) -> list[Result]:
        """Send ``reqs`` at once (the retries), in order of ``reqs``."""
        return list(self._pool.map(self.send, reqs))

    # ---- the paced replay --------------------------------------------------------------------------
    def start(self) -> "Replay":
        self._pacer = threading.Thread(target=self._pace, name="replay-pacer", daemon=True)
        self._pacer.start()
        return self

    def _pace(self) -> None:
        t0 = time.monotonic()
        for req in self.requests:
            # Arrival pacing is the workload itself, not a wait on a condition.
            if self._stop.wait(max(0.0, t0 + req.arrival_s - time.monotonic())):
                return
            fut = self._pool.submit(self.send, req)
            with self._cond:
                self._futures.append(fut)
                self._submitted += 1
                self._cond.notify_all()

    def wait_for(self, submitted: int, streaming: int = 0, timeout_s: float = 30.0, streaming_s: float = 3.0) -> bool:
        """Until ``submitted`` requests are sent (AssertionError after ``timeout_s``), then up to ``streaming_s``
        more until ``streaming`` of them are mid-stream at once; returns whether they were."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._submitted >= submitted, timeout=timeout_s):
                raise AssertionError(f"replay: only {self._submitted} of {submitted} requests sent in {timeout_s}s")
            return self._cond.wait_for(lambda: self._streaming >= streaming, timeout=streaming_s)

    def join(self, timeout_s: float) -> list[Result]:
        """Every request's result, in replay order (a request still running after ``timeout_s`` is a hang)."""
        assert self._pacer is not None, "replay not started"
        self._pacer.join(timeout_s)
        assert not self._pacer.is_alive(), f"replay: arrivals not all sent within {timeout_s}s"
        done, pending = cf.wait(self._futures, timeout=timeout_s)
        assert not pending, f"replay: {len(pending)} request(s) still running {timeout_s}s after the last arrival"
        return [f.result() for f in self._futures]

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._channel.close()
