"""Opening gloo process groups directly (no ``init_process_group``), tuned for small messages.

Lifecycle: stateless. ``open_gloo(store, rank, size, timeout_s, host)`` blocks until every rank joined through
``store`` (or ``timeout_s`` passes) and returns a ``ProcessGroupGloo`` its caller owns: kvtransfer's two-rank
pair groups and the engine's tensor-parallel group are both opened here. Groups are constructed directly, so a
process holds any number of them and no process-wide default group exists. Imports torch: nothing the router
imports may import this module (``transport/__init__`` does not).
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Optional

import torch.distributed as dist


def timedelta_s(seconds: float) -> datetime.timedelta:
    """A gloo timeout: gloo treats 0 as "use the default", so at least a millisecond."""
    return datetime.timedelta(seconds=max(seconds, 0.001))


def socket_fds() -> set[int]:
    """This process's socket file descriptors (empty where /proc is missing)."""
    out = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: nothing to tune
        return out
    for fd in names:
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                out.add(int(fd))
        except OSError:
            pass
    return out


def set_nodelay(fds: set[int]) -> None:
    """TCP_NODELAY on the TCP sockets among ``fds``.

    Gloo leaves Nagle on for the side that accepts a connection, so its small control messages (recv-ready
    notices, acks, a decode step's all-reduce) wait for the peer's delayed ACK: measured here, 4 ms per
    kvtransfer header+payload frame instead of 0.2 ms. Socket options belong to the socket, so setting them
    through a dup of the fd is enough. Other TCP sockets opened meanwhile by other threads only get NODELAY
    too, which is harmless.
    """
    for fd in fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        finally:
            s.close()


def gloo_options(timeout_s: float, host: str):
    """Options pinning gloo's listener and advertised address to ``host``.

    Without a device gloo binds the address the machine's hostname resolves to, which may be any
    interface (or none reachable); a worker's ``host`` is the interface it was told to serve on."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta_s(timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return opts


def open_gloo(store: dist.Store, rank: int, size: int, timeout_s: float,
              host: Optional[str] = None) -> dist.ProcessGroupGloo:
    """A gloo group of ``size`` ranks over ``store``, its sockets with TCP_NODELAY; blocks until all joined."""
    before = socket_fds()
    pg = dist.ProcessGroupGloo(store, rank, size, gloo_options(timeout_s, host) if host else timedelta_s(timeout_s))
    set_nodelay(socket_fds() - before)
    return pg
