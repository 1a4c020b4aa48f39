"""`pdserve up` as a real subprocess: two clusters side by side, served, then SIGTERM leaves nothing behind.

Cluster A (1 prefill + 1 decode) runs on its own embedded Redis; cluster B
(one colocated worker, the baseline mode, with the planner on and its engine core in a process of its own,
``--engine-process``, inside the Ray actor) uses the test session's Redis
(``--redis-url``) so we can check that its keys are gone after exit.
Both start their own private Ray instance, next to the one the test process
may hold.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Optional

import grpc
import openai
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.redis_server import pick_free_port
from cluster.registry import Registry
from engine.sampling_params import SamplingParams
from tests.e2e.helpers import generate, offline
from tests.waiting import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pdserve() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "pdserve")
    return [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "cluster.cli"]


class UpProcess:
    """A `pdserve up` (or `controller`, `router`) subprocess whose stdout is read on a thread (so the pipe never
    fills); ready once it prints its banner (SERVING, or CONTROLLING for a controller)."""

    def __init__(self, *args: str, env: Optional[dict] = None, command: str = "up") -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")
        env = dict(env or os.environ, OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="0")
        if command != "controller":
            if "--http-port" not in args:
                args = ("--http-port", "0", *args)  # no HTTP API unless asked: two clusters must not share a port
            args = ("--port", "0", *args)
        self.banner = "pdserve CONTROLLING" if command == "controller" else "pdserve SERVING"
        self.proc = subprocess.Popen([*_pdserve(), command, *args], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.lines: list[str] = []
        self.serving = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith(self.banner):
                self.serving.set()

    def wait_serving(self, timeout_s: float) -> None:
        """Wait for the banner; AssertionError with the output's tail if it is late or the process exits."""
        wait_until(lambda: self.serving.is_set() or self.proc.poll() is not None, timeout=timeout_s, interval=0.1,
                   message=lambda: f"no {self.banner!r} (rc={self.proc.poll()}):\n{self.tail()}")
        if not self.serving.is_set():
            raise AssertionError(f"no {self.banner!r} (rc={self.proc.poll()}):\n{self.tail()}")

    def tail(self) -> str:
        self.stderr.seek(0)
        return "\n".join(self.lines) + "\n--- stderr ---\n" + self.stderr.read()[-4000:]

    @property
    def router(self) -> str:
        return re.search(r"router=(\S+)", self.lines[0]).group(1)

    def ports(self) -> set[int]:
        """Every port the process printed: router, metrics endpoints, Redis (its URL masked: redis://:***@...)."""
        text = "\n".join(self.lines)
        return {int(p) for p in re.findall(r"(?:router=|http://|redis://(?::\*\*\*@)?)[\w.\-]+:(\d+)", text)}

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def close(self) -> None:
        """After a failed test: stop gracefully (so its temp dirs go too), SIGKILL only if that hangs."""
        if self.proc.poll() is None:
            kids = self.descendants()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                for p in kids:
                    p.kill()
                self.proc.kill()
                self.proc.wait(10)
        self.stderr.close()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_two_pdserve_up_side_by_side_serve_and_sigterm_leaves_nothing(redis_url):
    ns_b = f"e2e-up-{uuid.uuid4().hex[:8]}"
    http_port = pick_free_port()
    a = UpProcess("--num-kv-blocks", "128", "--http-port", str(http_port))
    b = UpProcess("--num-kv-blocks", "128", "--redis-url", redis_url, "--namespace", ns_b, "--colocated", "1",
                  "--autoscale", "--engine-process")
    try:
        a.wait_serving(240)
        b.wait_serving(240)
        assert a.router != b.router
        for up in (a, b):
            assert _health(up.router) == health_pb2.HealthCheckResponse.SERVING
            assert any("/metrics" in line for line in up.lines), up.lines
        assert any(line.startswith("  planner  colocated 1..") for line in b.lines), b.lines
        # the CPU kernels were prepared where the user sees it (stderr), before any worker started
        a.stderr.seek(0)
        err = a.stderr.read()
        assert "preparing the CPU kernels" in err and "pdserve CPU kernels:" in err, err[-2000:]
        ref = offline(["def main():"], [SamplingParams(max_tokens=8, temperature=0.0)])[0]
        assert generate(a.router, prompt="def main():", max_tokens=8, temperature=0.0)[:3] == ref
        assert generate(b.router, prompt="def main():", max_tokens=8, temperature=0.0)[:3] == ref
        # The CLI client streams the same text to stdout.
        r = subprocess.run([*_pdserve(), "generate", "def main():", "--target", a.router, "--max-tokens", "8",
                            "--temperature", "0"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout == ref[1] + "\n", (r.stdout, r.stderr)
        # The OpenAI-compatible HTTP API of cluster A, through the official client: the same text.
        assert any(line.startswith(f"  http     http://127.0.0.1:{http_port}/v1") for line in a.lines), a.lines
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0, timeout=60)
        done = oai.completions.create(model="tiny", prompt="def main():", max_tokens=8, temperature=0)
        assert done.choices[0].text == ref[1]
        # `pdserve bench` (loadtest) against cluster B: every request completes.
        r = subprocess.run([*_pdserve(), "bench", "--target", b.router, "--num-prompts", "6", "--input-len", "24",
                            "--output-len", "4"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
        assert re.search(r"Successful requests\D+6\b", r.stdout), r.stdout[-2000:]
        reg_b = Registry(redis_url, ns_b)
        assert {w.role for w in reg_b.list()} == {"colocated"}

        procs = {up: up.descendants() for up in (a, b)}
        shared_redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        ports = {up: up.ports() - {shared_redis_port} for up in (a, b)}  # B's Redis is not B's to stop
        assert all(len(p) >= 3 for p in procs.values()), procs  # Ray's processes and the worker actors
        # B's worker actor runs its engine in a child process (multiprocessing spawn), which must go too
        assert any("multiprocessing" in " ".join(_cmdline(p)) for p in procs[b]), [_cmdline(p) for p in procs[b]]
        assert len(ports[a]) >= 5 and len(ports[b]) >= 3, ports  # router, HTTP (A), worker + router metrics, Redis (A)
        assert http_port in ports[a]
        for up in (a, b):
            up.proc.send_signal(signal.SIGTERM)
        for up in (a, b):
            t0 = time.monotonic()
            rc = up.proc.wait(timeout=15)
            assert rc == 0, up.tail()
            assert time.monotonic() - t0 < 10.0, "pdserve up took more than 10 s to stop"
        for up in (a, b):  # the children exit and their ports close soon after their parent
            wait_until(lambda up=up: not [p for p in procs[up] if _alive(p)]
                       and not [p for p in ports[up] if _listening(p)], timeout=10.0, interval=0.1,
                       message="every child of pdserve up exited and its ports closed")
            left = [p for p in procs[up] if _alive(p)]
            assert not left, [(p.pid, p.name()) for p in left]
            assert not [p for p in ports[up] if _listening(p)], ports[up]
        assert reg_b.keys() == [], "cluster B left keys in the shared Redis"
    finally:
        a.close()
        b.close()


def test_pdserve_cli_bad_arguments_exit_2_naming_the_flag():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy_port = str(busy.getsockname()[1])
        for args, flag in ((["up", "--prefill", "-1"], "--prefill"), (["up", "--model", "/no/such/dir"], "--model"),
                           (["up", "--port", "70000"], "--port"), (["up", "--port", busy_port], "--port"),
                           (["up", "--autoscale", "--max-decode", "0"], "--max-decode"),
                           (["generate", "hi", "--max-tokens", "0"], "--max-tokens")):
            t0 = time.monotonic()
            r = subprocess.run([*_pdserve(), *args], cwd=REPO, capture_output=True, text=True, timeout=60)
            assert r.returncode == 2, (args, r.stderr)
            assert flag in r.stderr, (args, r.stderr)
            assert time.monotonic() - t0 < 20, f"{args}: bad input must fail before starting a cluster"


def test_pdserve_generate_unreachable_target_fails_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    r = subprocess.run([*_pdserve(), "generate", "hi", "--target", f"127.0.0.1:{port}", "--timeout", "3"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30


def _rank_processes(up: UpProcess) -> list[psutil.Process]:
    """The tensor-parallel ranks: multiprocessing spawn children of a worker actor."""
    return [p for p in up.descendants() if "spawn_main" in " ".join(_cmdline(p)) and _alive(p)]


def test_a_tensor_parallel_worker_serves_the_offline_tokens_and_a_killed_rank_replaces_it_whole(redis_url):
    """`pdserve up` with one colocated worker split over two ranks: greedy output equals the one-rank offline
    engine's through the router; SIGKILL of its second rank fails that worker's engine, the supervisor replaces
    the worker whole (new id, new ranks, the dead one's ranks gone), and serving resumes with the same tokens."""
    ns = f"e2e-tp-{uuid.uuid4().hex[:8]}"
    up = UpProcess("--num-kv-blocks", "128", "--redis-url", redis_url, "--namespace", ns, "--prefill", "0",
                   "--decode", "0", "--colocated", "1", "--tensor-parallel-size", "2", "--check-interval", "1")
    try:
        up.wait_serving(240)
        ref = offline(["def main():"], [SamplingParams(max_tokens=12, temperature=0.0)])[0]
        assert generate(up.router, prompt="def main():", max_tokens=12, temperature=0.0)[:3] == ref
        reg = Registry(redis_url, ns)
        (first,) = [w.worker_id for w in reg.list()]
        ranks = _rank_processes(up)
        assert len(ranks) == 1, [_cmdline(p) for p in up.descendants()]
        ranks[0].kill()

        def replaced() -> bool:
            try:  # a request on the broken engine fails; the replacement serves
                generate(up.router, timeout=30, prompt="x", max_tokens=1, temperature=0.0)
            except grpc.RpcError:
                return False
            return [w.worker_id for w in reg.list()] not in ([], [first])

        wait_until(replaced, timeout=240, interval=1.0, message=lambda: f"no replacement:\n{up.tail()}")
        assert generate(up.router, prompt="def main():", max_tokens=12, temperature=0.0)[:3] == ref
        assert len(_rank_processes(up)) == 1  # the new worker's rank; the failed worker's are gone
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=30) == 0, up.tail()
        wait_until(lambda: reg.keys() == [], timeout=30, message="the cluster left keys in Redis")
    finally:
        up.close()
