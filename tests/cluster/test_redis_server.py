"""The embedded redis-server: a real process on a free port, gone after stop."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import redis

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from tests.waiting import wait_until


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    try:
        return wait_until(lambda: not _pid_alive(pid), timeout=timeout_s, message=f"pid {pid} still alive")
    except AssertionError:
        return False


def test_start_serves_and_stop_leaves_nothing():
    server = EmbeddedRedis().start()
    pid, port, url = server.pid, server.port, server.url
    tmpdir = server._tmpdir
    try:
        assert port > 0 and url == f"redis://:{server.password}@127.0.0.1:{port}/0"
        assert len(server.password) >= 32 and server.display_url == f"redis://:***@127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url)
        assert client.ping()
        client.set("k", "v")
        assert client.get("k") == b"v"
        # Persistence is off: no RDB snapshots, no AOF.
        assert client.config_get("save")["save"] == ""
        assert client.config_get("appendonly")["appendonly"] == "no"
        client.close()
        assert os.path.isdir(tmpdir)
    finally:
        server.stop()
    assert _wait_gone(pid), "redis-server still running after stop()"
    assert not _port_open(port)
    assert not os.path.exists(tmpdir)
    server.stop()  # idempotent
    with pytest.raises(RuntimeError):
        _ = server.url


def test_two_servers_side_by_side_are_isolated():
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.port != b.port and a.pid != b.pid
        ca, cb = redis.Redis.from_url(a.url), redis.Redis.from_url(b.url)
        ca.set("only-in-a", 1)
        assert cb.get("only-in-a") is None
        ca.close()
        cb.close()
        pids = (a.pid, b.pid)
    assert all(_wait_gone(p) for p in pids)


def test_context_manager_kills_on_exception():
    pid = None
    with pytest.raises(KeyError):
        with EmbeddedRedis() as server:
            pid = server.pid
            raise KeyError("boom")
    assert pid is not None and _wait_gone(pid)


def test_server_dies_with_its_parent_process():
    # A parent that is SIGKILLed never runs stop(); the parent-death signal must still end redis.
    code = textwrap.dedent("""
        import sys, time
        from cluster.redis_server import EmbeddedRedis
        s = EmbeddedRedis().start()
        print(s.pid, s._tmpdir, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        pid_text, tmpdir = parent.stdout.readline().split()
        redis_pid = int(pid_text)
        assert _pid_alive(redis_pid)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        parent.stdout.close()
    assert _wait_gone(redis_pid), "orphan redis-server survived its parent"
    shutil.rmtree(tmpdir, ignore_errors=True)  # a SIGKILLed parent cannot clean its temp dir


def test_fixed_busy_port_fails_cleanly():
    with EmbeddedRedis() as first:
        busy = EmbeddedRedis(RedisServerConfig(port=first.port, startup_timeout_s=3))
        with pytest.raises(RuntimeError, match="redis-server failed to start"):
            busy.start()
        assert busy.pid is None


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="port"):
        RedisServerConfig(port=70000)
    with pytest.raises(ValueError, match="startup_timeout_s"):
        RedisServerConfig(startup_timeout_s=0)
    with pytest.raises(FileNotFoundError):
        EmbeddedRedis(RedisServerConfig(binary="/nonexistent/redis-server")).start()


def test_spawned_server_outlives_the_thread_that_started_it():
    """``spawn=True`` (posix_spawn, no fork): the server shares this process's session and has no parent-death
    signal, so a fault thread that restarts Redis may end; the default launch dies with its starting thread."""
    import threading

    started: dict = {}

    def start(name: str, spawn: bool) -> None:
        started[name] = EmbeddedRedis(RedisServerConfig(spawn=spawn)).start()

    for name, spawn in (("spawned", True), ("forked", False)):
        t = threading.Thread(target=start, args=(name, spawn))
        t.start()
        t.join(30)
    spawned, forked = started["spawned"], started["forked"]
    try:
        assert os.getsid(spawned.pid) == os.getsid(0) != os.getsid(forked.pid)
        # the reference: the forked one got its parent-death signal when its thread ended
        wait_until(lambda: not _pid_alive(forked.pid), timeout=10, message="forked server outlived its thread")
        client = redis.Redis.from_url(spawned.url)
        assert client.ping() and client.config_get("save")["save"] == ""  # same config: stdin, password
        client.close()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=spawned.port).ping()
    finally:
        pid, tmpdir = spawned.pid, spawned._tmpdir
        spawned.stop()
        forked.stop()
    assert _wait_gone(pid) and not os.path.exists(tmpdir)
