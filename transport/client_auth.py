"""How a client reaches a secured PDServe endpoint: an API key, TLS trust, a client certificate.

Lifecycle: a command (``pdserve generate``, ``pdserve bench``) adds the flags with
``add_client_auth_args(parser)`` and turns the parsed flags into one ``ClientAuth``
with ``client_auth_from_args(args)`` (the key may come from ``PDSERVE_API_KEY``
instead of argv, which ``ps`` shows to every user: a key given on argv draws a
warning). Each call then sends ``auth.metadata()`` (``authorization: Bearer KEY``)
on a channel from ``auth.channel(target)`` / ``auth.aio_channel(target)``: plaintext
without ``ssl_ca_certs``, else TLS trusting those roots (and presenting a client
certificate for mutual TLS). HTTP clients (the OpenAI backend of ``pdserve bench``)
send ``auth.http_headers()`` and verify an ``https://`` server with ``auth.ssl_context()``. The key is kept out of ``repr`` and never printed.
"""
from __future__ import annotations

import argparse
import logging
import os
import ssl
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import grpc

from transport.auth import bearer_metadata
from transport.tls import read_pem

log = logging.getLogger(__name__)

API_KEY_ENV = "PDSERVE_API_KEY"
"""Environment variable with the API key (comma-separated keys: the client sends the first)."""


@dataclass(frozen=True)
class ClientAuth:
    """Credentials of a client of the public API (all optional)."""

    api_key: Optional[str] = field(default=None, repr=False)
    """Sent as ``authorization: Bearer <key>`` on every call."""
    ssl_ca_certs: Optional[str] = None
    """PEM roots to verify the server with; set: the channel is TLS."""
    ssl_certfile: Optional[str] = None
    """PEM client certificate chain (mutual TLS), with ``ssl_keyfile``."""
    ssl_keyfile: Optional[str] = None
    """PEM key of ``ssl_certfile``."""
    ssl_server_name: Optional[str] = None
    """Name to check the server's certificate against instead of the target's host."""

    def __post_init__(self) -> None:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("--ssl-certfile and --ssl-keyfile must be given together")
        if self.ssl_certfile is not None and self.ssl_ca_certs is None:
            raise ValueError("--ssl-certfile (a client certificate) needs --ssl-ca-certs (TLS)")
        if self.api_key is not None and (not self.api_key or any(c.isspace() for c in self.api_key)):
            raise ValueError("the API key must be non-empty without whitespace (its value is not shown)")

    @property
    def tls(self) -> bool:
        return self.ssl_ca_certs is not None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata carrying the API key (empty without one)."""
        return bearer_metadata(self.api_key) if self.api_key else ()

    def credentials(self) -> Optional[grpc.ChannelCredentials]:
        """TLS channel credentials, or None for plaintext; ValueError naming the flag of an unreadable file."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem("--ssl-ca-certs", self.ssl_ca_certs),
            private_key=read_pem("--ssl-keyfile", self.ssl_keyfile),
            certificate_chain=read_pem("--ssl-certfile", self.ssl_certfile))

    def http_headers(self) -> dict[str, str]:
        """HTTP headers carrying the API key (OpenAI's ``Authorization: Bearer``; empty without one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def ssl_context(self) -> Optional[ssl.SSLContext]:
        """TLS context for an ``https://`` base URL: the ``ssl_ca_certs`` roots (and a client certificate), or
        None to use the system's roots; ValueError naming the flag of an unreadable file."""
        if not self.tls:
            return None
        read_pem("--ssl-ca-certs", self.ssl_ca_certs)
        ctx = ssl.create_default_context(cafile=self.ssl_ca_certs)
        if self.ssl_certfile is not None:
            read_pem("--ssl-certfile", self.ssl_certfile)
            read_pem("--ssl-keyfile", self.ssl_keyfile)
            ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        return ctx

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.ssl_server_name)] if self.ssl_server_name else []

    def channel(self, target: str) -> grpc.Channel:
        """A blocking channel to ``target`` (TLS when ``ssl_ca_certs`` is set)."""
        creds = self.credentials()
        if creds is None:
            return grpc.insecure_channel(target)
        return grpc.secure_channel(target, creds, options=self.options())

    def aio_channel(self, target: str) -> grpc.aio.Channel:
        """An asyncio channel to ``target`` (TLS when ``ssl_ca_certs`` is set)."""
        creds = self.credentials()
        if creds is None:
            return grpc.aio.insecure_channel(target)
        return grpc.aio.secure_channel(target, creds, options=self.options())


def add_client_auth_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``ClientAuth`` (``--api-key``, ``--ssl-ca-certs``, ``--ssl-certfile``, ...)."""
    g = p.add_argument_group("security")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"API key of the router (visible in `ps`: prefer the {API_KEY_ENV} environment variable)")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="PEM CA bundle to verify the router with; given: connect over TLS")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE", help="PEM client certificate (mutual TLS)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="PEM key of --ssl-certfile")
    g.add_argument("--ssl-server-name", default=None, metavar="NAME",
                   help="name to verify the router's certificate against (default: the target's host)")


def client_auth_from_args(args: argparse.Namespace, environ: Optional[dict] = None) -> ClientAuth:
    """A ``ClientAuth`` from ``add_client_auth_args``'s flags; the key from argv, else ``PDSERVE_API_KEY``."""
    environ = os.environ if environ is None else environ
    key = args.api_key
    if key is not None:
        print(f"warning: --api-key is visible to every user of this machine (ps); set {API_KEY_ENV} instead",
              file=sys.stderr)
    else:
        keys = [k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]
        key = keys[0] if keys else None
    return ClientAuth(api_key=key, ssl_ca_certs=args.ssl_ca_certs, ssl_certfile=args.ssl_certfile,
                      ssl_keyfile=args.ssl_keyfile, ssl_server_name=args.ssl_server_name)
