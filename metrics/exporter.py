"""HTTP /metrics endpoint for one ``CollectorRegistry``.

Lifecycle: ``serve_registry(registry, host, port)`` starts prometheus-client's
WSGI server on a daemon thread and returns its bound address and a ``stop``
function; ``stop`` shuts the server down, closes its socket and joins the
thread (calling it twice is harmless). Port 0 (the default) binds a free port,
so any number of endpoints can run side by side in one process or machine.
"""
from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import CollectorRegistry, start_http_server

from transport.ports import check_port


def serve_registry(registry: CollectorRegistry, host: str = "127.0.0.1",
                   port: int = 0) -> tuple[str, Callable[[], None]]:
    """Serve ``registry`` at http://HOST:PORT/metrics; returns ("host:port", stop)."""
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be a non-empty string, got {host!r}")
    check_port(port, "port")
    # prometheus-client >= 0.20 returns (server, thread), which is what lets us stop it.
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound_port = server.server_address[1]
    address = f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"
    lock = threading.Lock()
    stopped = False

    def stop() -> None:
        nonlocal stopped
        with lock:
            if stopped:
                return
            stopped = True
        server.shutdown()
        server.server_close()
        thread.join(timeout=5.0)

    return address, stop
