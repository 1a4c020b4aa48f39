"""One request's shared state in the router: identity, deadline, cancellation, live worker calls.

Lifecycle: the flow builds a ``RequestScope`` for a validated request when it is admitted.
Every worker call the request makes is ``track``ed; ``cancel()`` (client cancel or deadline,
from a gRPC or HTTP callback thread) cancels them all at once and makes every later wait
stop. ``remaining(cap)`` bounds each call by the request's deadline; ``rpc_error`` turns a
failed worker call into the ``FlowError`` the request ends with. ``finish()`` marks a normal
end, after which a late cancel callback no longer touches the calls (the prefill stream may
still be delivering TransferDone).
"""
from __future__ import annotations

import re
import threading
import time
from typing import Any, Optional

import grpc

from engine import SamplingParams
from router.events import FlowError
from router.validation import ValidatedRequest
from router.wire import params_to_wire


_ADDRESS = re.compile(r"(?:ipv4:|ipv6:|unix:|dns:)\S+|\[[0-9A-Fa-f:.]+\](?::\d+)?|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"
                      r"|\blocalhost:\d+\b")


def scrub(details: str) -> str:
    """A worker's error text without network addresses (clients see it; the cluster's layout is not theirs)."""
    return _ADDRESS.sub("<address>", details)[:500]


class RequestScope:
    """Per-request state shared by placement, the flow and its helper threads."""

    @property
    def rpc_kw(self) -> dict:
        """Extra keyword arguments of a worker RPC: the trace context's metadata, when there is one."""
        return {"metadata": self.trace_metadata} if self.trace_metadata else {}

    def __init__(self, vreq: ValidatedRequest, t0: float, deadline: float, seq: int = 0) -> None:
        self.rid = vreq.request_id
        self.prompt_token_ids: list[int] = vreq.prompt_token_ids
        self.params: SamplingParams = vreq.params
        self.n = vreq.n
        self.choice_params: list[SamplingParams] = vreq.choice_params()
        """Each choice's params (choice i: seed + i); choice 0's are the request's own."""
        self.lora_root = vreq.lora_root
        self.wire_params = params_to_wire(self.choice_params[0], vreq.lora_root)
        self.sibling_wires = [params_to_wire(p, vreq.lora_root) for p in self.choice_params[1:]]
        """The wire params of choices 1..n-1 (what a worker's ``siblings`` field carries)."""
        self.t0 = t0
        """time.monotonic() when the request arrived."""
        self.deadline = deadline
        self.seq = seq
        self.trace_span: Any = None
        """The request's root span (``transport.tracing``), None while tracing is off."""
        self.trace_metadata: tuple = ()
        """The W3C trace-context pairs every worker RPC of the request carries (empty while tracing is off)."""
        """Arrival number, fixed at admission so racing requests queue in arrival order."""
        self._lock = threading.Lock()
        self._calls: list[Any] = []
        self._cancelled = False
        self._finished = False
        self._hashes_by_bs: dict[int, list[int]] = {}
        self._worker_ids = 0

    def next_worker_request_id(self) -> str:
        """The id the workers know one placement of this request by: the client's id for the first, then
        ``<id>~2``, ``<id>~3``... A retry or a migration never reuses an id a worker may still hold (an abort
        that timed out, a reply lost in transit), so no worker answers ALREADY_EXISTS to a retry."""
        with self._lock:
            self._worker_ids += 1
            n = self._worker_ids
        return self.rid if n == 1 else f"{self.rid}~{n}"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> bool:
        """Cancel every live call; False (nothing done) after a normal ``finish``."""
        with self._lock:
            if self._finished:
                return False
            self._cancelled = True
            calls = list(self._calls)
        for c in calls:
            c.cancel()
        return True

    def finish(self) -> None:
        with self._lock:
            self._finished = True

    def track(self, call: Any) -> Any:
        """Remember a live worker call (cancelled at once if the request already is)."""
        with self._lock:
            self._calls.append(call)
            cancelled = self._cancelled
        if cancelled:
            call.cancel()
        return call

    def remaining(self, cap: float) -> float:
        """Seconds a call may take: ``cap``, or less if the deadline is nearer; DEADLINE_EXCEEDED if past."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise FlowError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {self.rid}: deadline exceeded")
        return min(cap, left)

    def stop_reason(self) -> Optional[str]:
        return "cancelled" if self._cancelled else None

    def rpc_error(self, e: grpc.RpcError, what: str, worker_id: str = "") -> FlowError:
        """The error a failed worker call ends this request with (a lost worker reads as UNAVAILABLE)."""
        if self._cancelled:
            return FlowError(grpc.StatusCode.CANCELLED, f"request {self.rid} cancelled")
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        details = e.details() if hasattr(e, "details") else str(e)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= self.deadline:
            return FlowError(code, f"request {self.rid}: deadline exceeded during {what}")
        if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                    grpc.StatusCode.DEADLINE_EXCEEDED):
            # the worker went away mid-call, broke, or did not answer within the call's own timeout while the
            # request still has time (a starved or wedged worker): another may serve it
            code = grpc.StatusCode.UNAVAILABLE
        return FlowError(code, f"request {self.rid}: {what} failed: {scrub(details or code.name)}", worker_id)

    def prefix_hashes(self, block_size: int) -> list[int]:
        """The prompt's prefix-cache block hashes for workers with this block size (computed once)."""
        from engine import lora_key_root, prefix_block_hashes, salted_root

        if block_size not in self._hashes_by_bs:
            # an adapter's blocks are its own (engine/lora.py), a salt's too: rooted where its workers root them
            root = salted_root(self.lora_root or lora_key_root(self.params.lora_name), self.params.cache_salt)
            self._hashes_by_bs[block_size] = prefix_block_hashes(self.prompt_token_ids, block_size, root)
        return self._hashes_by_bs[block_size]
