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


def test_two_pdserve_up_side_by_side_serve_and_sigterm_leaves_nothing(redis_url, tmp_path):
    from tests.roles.test_lora_cluster import make_tiny_adapters

    ns_b = f"e2e-up-{uuid.uuid4().hex[:8]}"
    http_port = pick_free_port()
    adapters = make_tiny_adapters(tmp_path)  # B serves LoRA adapters (in its worker's engine process)
    a = UpProcess("--num-kv-blocks", "128", "--http-port", str(http_port))
    b = UpProcess("--num-kv-blocks", "128", "--redis-url", redis_url, "--namespace", ns_b, "--colocated", "1",
                  "--autoscale", "--engine-process", "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()))
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
        from engine import LLM

        lora_ref = LLM(model="tiny", num_kv_blocks=128, num_threads=1, lora_modules=adapters).generate(
            ["def main():"], [SamplingParams(max_tokens=8, temperature=0.0, lora_name="py")])[0]
        assert lora_ref.token_ids != ref[0]
        got = wait_until(lambda: generate(b.router, prompt="def main():", max_tokens=8, temperature=0.0, model="py"),
                         30, message="the router has not learned B's adapters")  # (its view refreshes)
        assert got[0] == lora_ref.token_ids
        r = subprocess.run([*_pdserve(), "generate", "def main():", "--target", b.router, "--model", "py",
                            "--max-tokens", "8", "--temperature", "0"], cwd=REPO, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and r.stdout == lora_ref.text + "\n", (r.stdout, r.stderr)
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
    """The tensor-parallel ranks: multiprocessing spawn children of a worker actor (a Ray worker process)."""
    out = []
    for p in up.descendants():
        if "spawn_main" in " ".join(_cmdline(p)) and _alive(p):
            try:
                parent = " ".join(p.parent().cmdline())
            except psutil.Error:
                continue
            if "ray::" in parent:
                out.append(p)
    return out


def test_tensor_parallel_decode_workers_serve_the_offline_tokens_and_a_killed_rank_migrates_its_requests(redis_url):
    """`pdserve up` with one prefill worker at TP=1 and two decode workers at TP=2 (`--decode-tp 2`): KV moves
    from one whole cache to two ranks' halves and greedy output equals the one-rank offline engine's. SIGKILL of
    one decode worker's second rank while requests stream: every request still completes with the offline
    tokens (the router migrates what that worker held), the supervisor replaces the worker whole (its ranks
    gone, a new worker with new ranks), and SIGTERM leaves no key behind."""
    import concurrent.futures

    ns = f"e2e-tp-{uuid.uuid4().hex[:8]}"
    up = UpProcess("--num-kv-blocks", "128", "--redis-url", redis_url, "--namespace", ns, "--prefill", "1",
                   "--decode", "2", "--decode-tp", "2", "--check-interval", "1")
    try:
        up.wait_serving(300)
        params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
        prompts = ["def main():", "class Stack:", "import os\n", "for i in range(10):"]
        refs = offline(prompts, [params] * len(prompts))
        assert generate(up.router, prompt=prompts[0], max_tokens=96, temperature=0.0, ignore_eos=True)[:3] == refs[0]
        reg = Registry(redis_url, ns)
        decodes = sorted(w.worker_id for w in reg.list() if w.role == "decode")
        assert len(decodes) == 2 and all(w.tensor_parallel_size == 2 for w in reg.list() if w.role == "decode")
        ranks = _rank_processes(up)  # the decode workers' second ranks (the prefill worker has one rank)
        assert len(ranks) == 2, [_cmdline(p) for p in up.descendants()]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futs = [pool.submit(generate, up.router, 180.0, prompt=p, max_tokens=96, temperature=0.0,
                                ignore_eos=True) for p in prompts]
            time.sleep(0.3)  # the requests are streaming (96 tokens at TP=2 take seconds on this box)
            victim = ranks[0]
            victim_parent = victim.parent().pid
            victim.kill()
            got = [f.result(timeout=240)[:3] for f in futs]
        assert got == refs
        router_metrics = next(re.search(r"(http://\S+/metrics)", line).group(1) for line in up.lines
                              if line.strip().startswith("metrics") and " router " in line)
        import urllib.request

        text = urllib.request.urlopen(router_metrics, timeout=10).read().decode()
        migrated = sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("pdserve:request_migrations_total"))
        assert migrated >= 1, "no request was streaming on the killed worker: the test proved nothing"
        wait_until(lambda: sorted(w.worker_id for w in reg.list() if w.role == "decode") not in ([], decodes)
                   and len([w for w in reg.list() if w.role == "decode"]) == 2, timeout=240, interval=1.0,
                   message=lambda: f"no replacement decode worker:\n{up.tail()}")
        assert not psutil.pid_exists(victim_parent) or not _alive(psutil.Process(victim_parent))
        wait_until(lambda: len(_rank_processes(up)) == 2, timeout=60,
                   message="the replaced worker's ranks")
        assert generate(up.router, prompt=prompts[1], max_tokens=96, temperature=0.0, ignore_eos=True)[:3] == refs[1]
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=30) == 0, up.tail()
        wait_until(lambda: reg.keys() == [], timeout=30, message="the cluster left keys in Redis")
    finally:
        up.close()
