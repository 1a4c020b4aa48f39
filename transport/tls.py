"""TLS files of a pdserve endpoint, and the one PEM reader every side uses.

Lifecycle: a server's config names its files in a ``TlsFiles``; ``server_credentials(tls)``
reads them once, when the server is built (so a wrong path fails before anything binds),
for ``add_secure_port`` (mutual TLS when a client CA is given). Clients read theirs through
``read_pem`` too (``transport.client_auth``). An unreadable file is a ``ValueError`` naming
the setting or flag that gave it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import grpc


def read_pem(name: str, path: Optional[str]) -> Optional[bytes]:
    """The bytes of the PEM file at ``path`` (None for None); ValueError naming ``name`` (the setting or flag)
    when it cannot be read."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{name}: cannot read {path!r}: {e.strerror}") from None


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a TLS server: its certificate chain and key, and optionally the CA its clients must present."""

    certfile: str
    keyfile: str
    ca_certs: Optional[str] = None
    """Set: mutual TLS (clients need a certificate signed by this CA)."""


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Credentials for ``add_secure_port``; ValueError naming the file that cannot be read."""
    cert, key = read_pem("ssl_certfile", tls.certfile), read_pem("ssl_keyfile", tls.keyfile)
    ca = read_pem("ssl_ca_certs", tls.ca_certs)
    return grpc.ssl_server_credentials(((key, cert),), root_certificates=ca, require_client_auth=ca is not None)
