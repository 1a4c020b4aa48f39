"""The Redis a cluster runs on: the one it was given, or a private embedded one; and its registry.

Lifecycle of a ``ClusterRedis(config, namespace)``:

1. ``start()``: with ``config.redis_url`` that Redis is used as it is (it may carry a password, or be
   ``rediss://``); else a private ``EmbeddedRedis`` starts on a free port of ``config.host`` with a generated
   password. Bound to that host only, never widened behind the user's back: a loopback host on a joined
   Ray, or a wildcard host, is warned about. Then the namespace's ``Registry`` is opened and pinged.
   ``url`` (with its password) is a secret; ``display_url`` masks it.
2. ``clear_stale(wait_s)``: a named namespace may hold what a killed run left (kvtransfer rendezvous keys
   live 10 min); its keys are deleted, unless live workers still heartbeat there (then it raises instead
   of taking a running cluster's keys).
3. ``close()``: closes the registry's connection and stops the embedded server (if any). Idempotent.
"""
from __future__ import annotations

import logging
from typing import Optional

from cluster.config import ClusterConfig
from cluster.redis_server import EmbeddedRedis, RedisServerConfig, mask_url, url_with_password
from cluster.registry import Registry

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARD = ("0.0.0.0", "::", "")


class ClusterRedis:
    """The Redis of one cluster and its registry (see module docstring)."""

    def __init__(self, config: ClusterConfig, namespace: str) -> None:
        self.config = config
        self.namespace = namespace
        self.url: Optional[str] = None
        """The Redis URL with its password (a secret: log ``display_url``); None before ``start()``."""
        self.registry: Optional[Registry] = None
        self._embedded: Optional[EmbeddedRedis] = None

    def start(self) -> Registry:
        """Use the given Redis or start the embedded one; open and ping the registry and return it."""
        if self.config.redis_url:
            self.url = self.config.redis_url
        else:
            host = self.config.host
            joined = self.config.ray_address is not None
            if joined and host in LOOPBACK:
                log.warning("embedded Redis binds %s: workers on other nodes cannot reach it (give --host "
                            "this node's address, or --redis-url)", host)
            if host in WILDCARD:
                log.warning("embedded Redis binds every interface (host %s was given explicitly)", host)
            self._embedded = EmbeddedRedis(RedisServerConfig(host=host)).start()
            self.url = self._embedded.url
            if host in WILDCARD and joined:
                import ray  # the address other nodes reach this one at

                self.url = url_with_password("redis", ray.util.get_node_ip_address(), self._embedded.port,
                                             self._embedded.password)
        self.registry = Registry(self.url, self.namespace, ttl_s=self.config.ttl_s)
        self.registry.ping()
        return self.registry

    def clear_stale(self, wait_s: float) -> None:
        """Delete what a killed run left in this namespace (``Registry.clear_stale``; refused while live
        workers still heartbeat in it)."""
        self.registry.clear_stale(wait_s=wait_s)

    @property
    def display_url(self) -> str:
        """``url`` with its password masked (for logs and banners)."""
        return mask_url(self.url)

    def close(self) -> None:
        """Close the registry's connection and stop the embedded server; safe to call twice."""
        if self.registry is not None:
            self.registry.close()
        if self._embedded is not None:
            self._embedded.stop()
