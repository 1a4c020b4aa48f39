"""Waiting for a prefill worker's TransferDone without holding up the decode stream.

Lifecycle: once the first token arrived, the disaggregated flow starts a
``TransferWatch`` on the prefill stream and calls ``Decode`` on the decode worker
at once (the decode worker itself waits until the KV has landed before it adds
the request to its batch). The watch's thread reads the prefill stream's last
event: TransferDone (``kv_transfer_s`` is set) or an error (``error``, and the
guarded decode call is cancelled, so the flow ends with the transfer's failure
instead of waiting on a decode that cannot start). Either way ``on_end`` runs
once (the flow releases its prefill worker's load count).

Why not read TransferDone before calling Decode: a prefill worker reports it only
between two engine steps, so a busy prefill worker (a long prompt in its current
step) would hold every finished transfer's second token for up to a whole step.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import grpc


class TransferWatch:
    """Reads TransferDone (or the failure) from a prefill stream on its own thread."""

    def __init__(self, p_stream: Any, request_id: str, on_end: Callable[[], None],
                 to_error: Callable[[Optional[grpc.RpcError], str], Exception],
                 on_ok: Optional[Callable[[], None]] = None) -> None:
        """``on_ok`` runs (on the watch's thread, before ``on_end``) when TransferDone arrives."""
        self._stream = p_stream
        self._on_ok = on_ok
        self._on_end = on_end
        self._to_error = to_error
        self._lock = threading.Lock()
        self._guarded: Optional[Any] = None
        self.kv_transfer_s: Optional[float] = None
        """Prefill worker's first token -> KV acknowledged by the decode worker, once known."""
        self.error: Optional[Exception] = None
        """Why the transfer failed (a FlowError from ``to_error``), once known."""
        self._thread = threading.Thread(target=self._run, name=f"kv-watch-{request_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        err: Optional[Exception] = None
        try:
            ev = next(self._stream)
            if ev.HasField("transfer_done"):
                self.kv_transfer_s = ev.transfer_done.kv_transfer_s
                if self._on_ok is not None:
                    self._on_ok()
            else:
                err = self._to_error(None, f"prefill worker sent {ev.WhichOneof('event')} instead of TransferDone")
        except grpc.RpcError as e:
            err = self._to_error(e, "")
        except StopIteration:
            err = self._to_error(None, "prefill stream ended before TransferDone")
        finally:
            self._on_end()
        if err is not None:
            with self._lock:
                self.error = err
                victim = self._guarded
            if victim is not None:
                victim.cancel()

    def guard(self, call: Any) -> None:
        """Cancel ``call`` if the transfer fails (already failed: at once)."""
        with self._lock:
            self._guarded = call
            failed = self.error is not None
        if failed:
            call.cancel()

    def done(self, timeout_s: float = 0.0) -> bool:
        """Whether the outcome is known (waits up to ``timeout_s``)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
