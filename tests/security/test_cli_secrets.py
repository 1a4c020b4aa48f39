"""Where the CLI takes secrets from, and that nothing prints them: flags, files, environment, reprs, errors.

Fast: no cluster is started (the `pdserve up` runs here fail on their arguments before starting anything).
"""
from __future__ import annotations

import argparse
import os
import subprocess

import pytest

from cluster import up_secrets as cli
from cluster.cli import build_parser
from cluster.config import ClusterConfig
from cluster.worker_actor import WorkerSpec
from transport.client_auth import ClientAuth, client_auth_from_args
from tests.e2e.test_pdserve_up import REPO, _pdserve

SECRET = "s3cret-" + "x" * 24


def _up_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


@pytest.fixture
def clean_env(monkeypatch):
    for name in cli.SECRET_ENVS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_up_secrets_from_environment_and_files_then_removed_from_the_environment(clean_env, tmp_path, capsys):
    clean_env.setenv("PDSERVE_API_KEY", "env-key-1, env-key-2")
    clean_env.setenv("PDSERVE_CLUSTER_SECRET", SECRET)
    clean_env.setenv("PDSERVE_REDIS_URL", "redis://:pw-123@10.0.0.5:6379/0")
    keys, secret, url = cli.read_up_secrets(_up_args())
    assert keys == ("env-key-1", "env-key-2") and secret == SECRET and url == "redis://:pw-123@10.0.0.5:6379/0"
    assert not [n for n in cli.SECRET_ENVS if n in os.environ]  # Ray's processes will not inherit them
    assert capsys.readouterr().err == ""  # nothing on argv: no warning

    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    f.chmod(0o644)
    keys, secret, url = cli.read_up_secrets(_up_args("--api-key", "argv-key", "--cluster-secret-file", str(f),
                                                 "--redis-url", "redis://:pw-123@h:1/0"))
    err = capsys.readouterr().err
    assert keys == ("argv-key",) and secret == SECRET
    assert "--api-key is visible" in err and "PDSERVE_API_KEY" in err
    assert "--redis-url password is visible" in err and "readable by other users" in err
    assert SECRET not in err and "argv-key" not in err and "pw-123" not in err


def test_short_cluster_secret_is_refused_without_showing_it(clean_env, tmp_path):
    f = tmp_path / "secret"
    f.write_text("tooshort-9")
    f.chmod(0o600)
    with pytest.raises(ValueError) as e:
        cli.read_up_secrets(_up_args("--cluster-secret-file", str(f)))
    assert "16 characters" in str(e.value) and "tooshort-9" not in str(e.value)
    with pytest.raises(ValueError, match="cannot read"):
        cli.read_up_secrets(_up_args("--cluster-secret-file", str(tmp_path / "missing")))


def test_configs_keep_secrets_out_of_repr():
    cfg = ClusterConfig(api_keys=("api-key-abc",), cluster_secret=SECRET, redis_url="redis://:pw-123@h:1/0")
    text = repr(cfg)
    assert "api-key-abc" not in text and SECRET not in text and "pw-123" not in text
    spec = WorkerSpec(worker_id="p0", role="prefill", factory=print, redis_url="redis://:pw-123@h:1/0",
                      namespace="ns")
    assert "pw-123" not in repr(spec)
    with pytest.raises(ValueError) as e:
        ClusterConfig(cluster_secret="short-secret")
    assert "short-secret" not in str(e.value)


def test_client_auth_key_from_argv_or_environment(capsys):
    ns = argparse.Namespace(api_key=None, ssl_ca_certs=None, ssl_certfile=None, ssl_keyfile=None,
                            ssl_server_name=None)
    auth = client_auth_from_args(ns, environ={"PDSERVE_API_KEY": "k1,k2"})
    assert auth.metadata() == (("authorization", "Bearer k1"),) and not auth.tls and "k1" not in repr(auth)
    assert capsys.readouterr().err == ""
    ns.api_key = "argv-key"
    assert client_auth_from_args(ns, environ={}).metadata() == (("authorization", "Bearer argv-key"),)
    assert "--api-key is visible" in capsys.readouterr().err
    assert ClientAuth().metadata() == ()
    with pytest.raises(ValueError, match="--ssl-keyfile"):
        ClientAuth(ssl_ca_certs="ca.pem", ssl_certfile="c.pem")


@pytest.mark.parametrize("args,flag", [
    (["up", "--ssl-certfile", "/nonexistent/cert.pem"], "--ssl-keyfile"),
    (["up", "--ssl-certfile", "/nonexistent/c.pem", "--ssl-keyfile", "/nonexistent/k.pem"], "--ssl-certfile"),
    (["up", "--ssl-ca-certs", "/nonexistent/ca.pem"], "--ssl-ca-certs"),
    (["down", "--namespace", "x"], "--redis-url"),
    (["bench", "--ssl-ca-certs", "/nonexistent/ca.pem", "--target", "127.0.0.1:1"], "--ssl-ca-certs"),
    (["generate", "hi", "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem"], "--ssl-ca-certs"),
])
def test_bad_security_flags_exit_2_naming_the_flag(args, flag):
    env = {k: v for k, v in os.environ.items() if k not in cli.SECRET_ENVS}
    r = subprocess.run([*_pdserve(), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and flag in r.stderr, (args, r.returncode, r.stderr)
