"""The one PEM reader and the server credentials built on it: bytes back, or a ValueError naming the setting."""
from __future__ import annotations

from pathlib import Path

import pytest

from transport.client_auth import ClientAuth
from transport.serving import GrpcServing
from transport.tls import TlsFiles, read_pem, server_credentials


def test_read_pem_returns_the_bytes_or_none(tmp_path: Path) -> None:
    f = tmp_path / "ca.pem"
    f.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    assert read_pem("ssl_ca_certs", str(f)) == b"-----BEGIN CERTIFICATE-----\n"
    assert read_pem("ssl_ca_certs", None) is None


def test_an_unreadable_file_names_the_setting_it_came_from(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ValueError, match=r"^ssl_keyfile: cannot read .*nope\.pem"):
        server_credentials(TlsFiles(certfile=__file__, keyfile=missing))
    with pytest.raises(ValueError, match=r"^ssl_keyfile: cannot read"):  # read when the server is built
        GrpcServing("t", tls=TlsFiles(certfile=__file__, keyfile=missing))
    with pytest.raises(ValueError, match=r"^--ssl-ca-certs: cannot read"):  # the client reads through it too
        ClientAuth(ssl_ca_certs=missing).credentials()


@pytest.mark.parametrize("port", [-1, 65536, True, "80"])
def test_grpc_serving_checks_its_port(port: object) -> None:
    with pytest.raises(ValueError, match=r"^port must be an integer port"):
        GrpcServing("t", port=port)  # type: ignore[arg-type]
