"""`pdserve up` with its security options, as a real subprocess, seen as another user of the machine would.

One run on ``--host 127.0.0.2`` (loopback, but neither the hostname's address nor the usual 127.0.0.1, so
a listener that ignores ``--host`` shows up), with TLS and an API key (from ``PDSERVE_API_KEY``) on the
public API and the cluster secret from a 0600 file:

- clients: ``pdserve generate`` / ``pdserve bench`` over TLS with the key get the offline greedy text; no
  key: UNAUTHENTICATED; a plaintext client on the TLS port fails; ``wait_serving`` works over TLS;
- the embedded Redis refuses a client without its password;
- every listening socket of the run's processes: in the processes that run pdserve's code (the launcher,
  the worker actors, redis-server) each one is on 127.0.0.2, except Ray's core-worker gRPC server that Ray
  starts inside every driver and worker process (found by its "listening on port N" lines in the run's Ray
  logs). Ray's own daemons (gcs_server, raylet, dashboard and runtime-env agents, idle workers) bind
  wildcards and the node IP by Ray's design: they are listed, not failed (docs/security.md, "Ray");
- no process of the run has the cluster secret, the API key or a Redis password on its command line
  (``ps``), none it started has them in its environment, and the banner and logs show none of them.
"""
from __future__ import annotations

import glob
import os
import re
import secrets
import signal
import subprocess

import psutil
import pytest
import redis

from cluster.serve_cli import wait_serving
from engine.sampling_params import SamplingParams
from transport.client_auth import ClientAuth
from tests.e2e.helpers import offline
from tests.e2e.test_pdserve_up import REPO, UpProcess, _pdserve

HOST = "127.0.0.2"
REDIS_PASSWORD_IN_URL = re.compile(r"rediss?://[^\s@/]*:(?!\*\*\*@)[^\s@/]+@")
RAY_SERVER_PORT = re.compile(r"server started, listening on port (\d+)")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    trustme = pytest.importorskip("trustme")
    d = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    leaf = ca.issue_cert(HOST)
    paths = {"ca": d / "ca.pem", "cert": d / "cert.pem", "key": d / "key.pem", "other_ca": d / "other.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    leaf.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    leaf.private_key_pem.write_to_path(str(paths["key"]))
    trustme.CA().cert_pem.write_to_path(str(paths["other_ca"]))
    return {k: str(v) for k, v in paths.items()}


def _procs(up: UpProcess) -> list[psutil.Process]:
    return [psutil.Process(up.proc.pid), *up.descendants()]


def _ray_ports(procs: list[psutil.Process]) -> set[int]:
    """Ports of the gRPC servers Ray's core worker starts in each driver/worker process (from Ray's logs)."""
    dirs = set()
    for p in procs:
        try:
            dirs |= set(re.findall(r"(/tmp/pdray[^/\s\"',=]+)", " ".join(p.cmdline())))
        except psutil.Error:
            pass
    ports: set[int] = set()
    for d in dirs:
        for path in glob.glob(os.path.join(d, "session_*", "logs", "*core-*.log")):
            with open(path, errors="replace") as f:
                ports |= {int(m) for m in RAY_SERVER_PORT.findall(f.read())}
    return ports


def _listeners(p: psutil.Process) -> list:
    try:
        return [c for c in p.net_connections("inet")
                if c.status == psutil.CONN_LISTEN or (c.type == 2 and c.laddr)]  # TCP listeners, bound UDP
    except psutil.Error:
        return []


def _plain_ip(ip: str) -> str:
    return ip[7:] if ip.startswith("::ffff:") else ip


def _runs_pdserve_code(p: psutil.Process, root_pid: int) -> bool:
    try:
        return p.pid == root_pid or p.name() == "redis-server" or "_WorkerActor" in " ".join(p.cmdline()[:1])
    except psutil.Error:
        return False


def _cli(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*_pdserve(), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_secure_pdserve_up_serves_only_with_credentials_binds_host_and_shows_no_secret(certs, tmp_path):
    cluster_secret = secrets.token_urlsafe(32)
    api_key = "key-" + secrets.token_urlsafe(24)
    secret_file = tmp_path / "cluster.secret"
    secret_file.write_text(cluster_secret + "\n")
    secret_file.chmod(0o600)
    env = dict(os.environ, PDSERVE_API_KEY=api_key)
    env.pop("PDSERVE_CLUSTER_SECRET", None)
    up = UpProcess("--host", HOST, "--num-kv-blocks", "64", "--ssl-certfile", certs["cert"],
                   "--ssl-keyfile", certs["key"], "--cluster-secret-file", str(secret_file), "--cluster-tls", env=env)
    try:
        up.wait_serving(280)
        banner = "\n".join(up.lines)
        assert up.router.startswith(f"{HOST}:"), banner
        assert "TLS, 1 API key(s) required" in banner and "redis://:***@127.0.0.2:" in banner, banner
        assert "over mutual TLS (cluster CA)" in banner, banner  # the cluster plane too: workers dialled over mTLS
        for secret in (cluster_secret, api_key):
            assert secret not in banner
        redis_port = int(re.search(r"redis://:\*\*\*@[\d.]+:(\d+)", banner).group(1))

        # Clients: TLS + key serve; no key, no TLS, or the wrong CA do not.
        wait_serving(up.router, 30, ClientAuth(ssl_ca_certs=certs["ca"]))
        ref = offline(["def main():"], [SamplingParams(max_tokens=6, temperature=0.0)])[0]
        client_env = dict(os.environ, PDSERVE_API_KEY=api_key)
        gen = ("generate", "def main():", "--target", up.router, "--max-tokens", "6", "--temperature", "0",
               "--timeout", "60")
        r = _cli(*gen, "--ssl-ca-certs", certs["ca"], env=client_env)
        assert r.returncode == 0 and r.stdout == ref[1] + "\n", (r.stdout, r.stderr)
        no_key = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
        r = _cli(*gen, "--ssl-ca-certs", certs["ca"], env=no_key)
        assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr, r.stderr
        r = _cli(*gen[:-1], "5", env=client_env)  # plaintext on the TLS port
        assert r.returncode == 1 and "UNAVAILABLE" in r.stderr, r.stderr
        r = _cli(*gen[:-1], "5", "--ssl-ca-certs", certs["other_ca"], env=client_env)
        assert r.returncode == 1 and "UNAVAILABLE" in r.stderr, r.stderr
        r = _cli("bench", "--target", up.router, "--ssl-ca-certs", certs["ca"], "--num-prompts", "3",
                 "--input-len", "24", "--output-len", "4", "--disable-tqdm", env=client_env)
        assert r.returncode == 0 and re.search(r"Successful requests\D+3\b", r.stdout), (r.stdout[-1500:], r.stderr)

        # The embedded Redis wants its password.
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=HOST, port=redis_port, socket_timeout=5).ping()

        # Listening sockets, after KV has moved (the gloo pairs exist).
        procs = _procs(up)
        ray_ports = _ray_ports(procs)
        assert ray_ports, "no Ray core-worker ports found in the run's Ray logs"
        ours, rays = [], []
        for p in procs:
            for c in _listeners(p):
                entry = (p.pid, p.name(), _plain_ip(c.laddr.ip), c.laddr.port)
                if _runs_pdserve_code(p, up.proc.pid) and c.laddr.port not in ray_ports:
                    ours.append(entry)
                else:
                    rays.append(entry)
        bad = [e for e in ours if e[2] != HOST]
        assert not bad, f"listeners of pdserve's own code not on --host {HOST}: {bad}"
        ports = {e[3] for e in ours}
        assert up.ports() <= ports, (up.ports(), ours)  # router, metrics endpoints, Redis: all seen and on HOST
        workers = [p for p in procs if _runs_pdserve_code(p, up.proc.pid) and p.name() != "redis-server"
                   and p.pid != up.proc.pid]
        assert len(workers) == 2 and all(sum(e[0] == w.pid for e in ours) >= 3 for w in workers), ours  # gRPC,
        # metrics and gloo in each worker
        print("Ray's own listeners (not pdserve's; see docs/security.md):", sorted(set(rays)))

        # What other users see (argv) and what the started processes inherited (environment).
        for p in procs:
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            assert cluster_secret not in cmd and api_key not in cmd, (p.pid, cmd)
            assert not REDIS_PASSWORD_IN_URL.search(cmd) and "requirepass" not in cmd, (p.pid, cmd)
            if p.pid == up.proc.pid:
                continue  # its own environment is what the test gave it
            try:
                environ = p.environ()
            except psutil.Error:
                continue
            values = "\n".join(environ.values())
            assert cluster_secret not in values and api_key not in values, (p.pid, p.name())
            assert not REDIS_PASSWORD_IN_URL.search(values), (p.pid, p.name())

        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(30) == 0, up.tail()
        log = up.tail()  # banner and everything logged, stop included
        assert cluster_secret not in log and api_key not in log and not REDIS_PASSWORD_IN_URL.search(log), log
    finally:
        up.close()
