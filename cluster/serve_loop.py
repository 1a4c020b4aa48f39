"""How a ``pdserve`` serving process runs: start, wait until ready, block until a signal, stop.

Lifecycle: ``run_until_signal(start, ready, stop, failed)`` installs SIGINT/SIGTERM handlers,
calls ``start()`` (a signal during it aborts it), takes SIGTERM back from Ray (``ray.init``
installs its own), calls ``ready()`` (usually ``wait_serving`` or ``wait_listening`` on the
router, then a banner), then blocks until a signal or until ``failed()`` names a reason, and
always calls ``stop()`` before restoring the previous handlers. ``wait_serving`` and
``wait_listening`` poll an address until it answers or a deadline passes.
"""
from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

from transport.client_auth import ClientAuth


class _Shutdown(BaseException):
    """Raised in the main thread by SIGINT/SIGTERM (a BaseException so no `except Exception` swallows it)."""


def wait_serving(address: str, timeout_s: float, auth: Optional[ClientAuth] = None) -> None:
    """Block until ``address`` answers grpc.health SERVING; TimeoutError otherwise.

    ``auth``: TLS trust (and client certificate) for a router serving TLS; health needs no API key."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with (auth or ClientAuth()).channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"router {address} not SERVING within {timeout_s}s")
            time.sleep(0.2)


def wait_listening(address: str, timeout_s: float) -> None:
    """Block until a TCP connection to ``address`` succeeds; TimeoutError otherwise."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"router {address} not listening within {timeout_s}s") from None
            time.sleep(0.2)


def run_until_signal(start: Callable[[], None], ready: Callable[[], None], stop: Callable[[], None],
                     failed: Callable[[], Optional[str]] = lambda: None) -> int:
    """``start()``, ``ready()``, then block until SIGINT/SIGTERM or until ``failed()`` names a reason (polled
    every second), then ``stop()``. A signal during start aborts it the same way. Returns 0, or 1 when
    ``failed()`` ended the run."""
    stop_event = threading.Event()
    stopping = False
    reason: Optional[str] = None

    def on_signal(signum: int, _frame) -> None:
        if stopping:
            return  # already tearing down: let it finish
        stop_event.set()
        raise _Shutdown(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        start()
        # ray.init installs its own SIGTERM handler (sys.exit(15)); take SIGTERM back for a clean stop.
        for s in previous:
            signal.signal(s, on_signal)
        ready()
        while not stop_event.wait(1.0):
            reason = failed()
            if reason:
                print(f"pdserve: {reason}, stopping", file=sys.stderr, flush=True)
                break
    except _Shutdown as e:
        print(f"pdserve: {e}, stopping", file=sys.stderr, flush=True)
    except SystemExit as e:
        if e.code != signal.SIGTERM:  # Ray's handler fired while the cluster was still starting
            raise
        print("pdserve: SIGTERM, stopping", file=sys.stderr, flush=True)
    finally:
        stopping = True
        try:
            stop()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    print("pdserve: stopped", file=sys.stderr, flush=True)
    return 1 if reason else 0
