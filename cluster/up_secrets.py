"""The secrets of ``pdserve up``, ``controller`` and ``router``: API keys, the cluster secret, the Redis URL.

Lifecycle: a command calls ``read_up_secrets(args)`` (``up``) or ``read_split_secrets(args)``
(``controller``, ``router``: the Redis URL and the cluster secret are required) once, after its
flags are checked and before anything starts. Each secret comes from a flag, a file or the
environment (``API_KEY_ENV``, ``CLUSTER_SECRET_ENV``, ``REDIS_URL_ENV``); a secret given on argv
is warned about (``ps`` shows it), a secret file readable by others too. Once read, the variables
are removed from this process's environment, so the Ray processes it starts do not inherit them:
the secrets reach the actors inside their configs. No secret is ever printed.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

from transport.client_auth import API_KEY_ENV

CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
"""Environment variable with the cluster secret (else --cluster-secret-file, else a generated one)."""
REDIS_URL_ENV = "PDSERVE_REDIS_URL"
"""Environment variable with the Redis URL (keeps its password off argv)."""
SECRET_ENVS = (API_KEY_ENV, CLUSTER_SECRET_ENV, REDIS_URL_ENV)


def redis_url_from_args(args: argparse.Namespace) -> Optional[str]:
    """--redis-url, else $PDSERVE_REDIS_URL; warns when a password was given on argv (ps shows it)."""
    from cluster.redis_server import mask_url

    if args.redis_url:
        if mask_url(args.redis_url) != args.redis_url:
            print(f"pdserve: warning: the --redis-url password is visible to every user of this machine (ps); "
                  f"set ${REDIS_URL_ENV} instead", file=sys.stderr)
        return args.redis_url
    return os.environ.get(REDIS_URL_ENV) or None


def read_secret_file(path: str) -> str:
    try:
        st = os.stat(path)
        with open(path, "r") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"--cluster-secret-file: cannot read {path!r}: {e.strerror}") from None
    if st.st_mode & 0o077:
        print(f"pdserve: warning: --cluster-secret-file {path} is readable by other users (chmod 600 it)",
              file=sys.stderr)
    return secret


def read_up_secrets(args: argparse.Namespace) -> tuple[tuple[str, ...], Optional[str], Optional[str]]:
    """(API keys, cluster secret or None to generate one, Redis URL or None) from flags, files and the
    environment. The variables are then removed from this process's environment, so the Ray processes it
    starts (and their actors) do not inherit them: the secrets reach the actors inside their configs."""
    keys = list(getattr(args, "api_key", []))
    if keys:
        print(f"pdserve: warning: --api-key is visible to every user of this machine (ps); "
              f"set ${API_KEY_ENV} (comma-separated) instead", file=sys.stderr)
    keys += [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    if any(not k or any(c.isspace() for c in k) for k in keys):
        raise ValueError("--api-key: keys must be non-empty without whitespace (values not shown)")
    if args.cluster_secret_file:
        secret = read_secret_file(args.cluster_secret_file)
    else:
        secret = os.environ.get(CLUSTER_SECRET_ENV) or None
    if secret is not None and len(secret) < 16:
        raise ValueError(f"--cluster-secret-file/${CLUSTER_SECRET_ENV}: the cluster secret must be at least "
                         f"16 characters (value not shown); make one with python -c 'import secrets; "
                         f"print(secrets.token_urlsafe(32))'")
    redis_url = redis_url_from_args(args)
    for name in SECRET_ENVS:
        os.environ.pop(name, None)
    return tuple(dict.fromkeys(keys)), secret, redis_url


def read_split_secrets(args: argparse.Namespace) -> tuple[tuple[str, ...], str, str]:
    """``read_up_secrets`` for a controller or router: the Redis URL and the cluster secret are required."""
    keys, secret, redis_url = read_up_secrets(args)
    if redis_url is None:
        raise ValueError(f"--redis-url (or ${REDIS_URL_ENV}) is required: the deployment's Redis")
    if secret is None:
        raise ValueError(f"--cluster-secret-file (or ${CLUSTER_SECRET_ENV}) is required: every controller and "
                         f"router of a deployment must share one cluster secret")
    return keys, secret, redis_url


def read_cluster_tls(args: argparse.Namespace) -> Optional[Any]:
    """The cluster plane's ``transport.cluster_tls.ClusterTls``: read from --cluster-ca/--cluster-cert/--cluster-key,
    made for this run with --cluster-tls (``pdserve up`` only), or None (plaintext behind the cluster secret)."""
    from transport import cluster_tls

    files = (args.cluster_ca, args.cluster_cert, args.cluster_key)
    if any(files):
        if getattr(args, "cluster_tls", False):
            raise ValueError("--cluster-tls makes a CA for this run: give it or --cluster-ca/--cluster-cert/"
                             "--cluster-key, not both")
        return cluster_tls.from_files(*files)
    return cluster_tls.generate() if getattr(args, "cluster_tls", False) else None


def secret_source(args: argparse.Namespace, secret: Optional[str]) -> str:
    return "file" if args.cluster_secret_file else "environment" if secret else "generated for this run"
