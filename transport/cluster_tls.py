"""Mutual TLS for the cluster plane (router -> worker gRPC): one cluster certificate signed by the cluster's CA.

Lifecycle: the launcher (``pdserve up``, ``pdserve controller``/``router``) builds one ``ClusterTls`` at start,
either ``generate()``d for the run (a fresh CA and certificate, like the generated cluster secret) or read from
mounted files (``from_files``: a CA bundle, a certificate and its key, e.g. issued by cert-manager into a
Kubernetes Secret). It travels, like the cluster secret, inside the worker and router configs. Each worker serves
its internal gRPC API with ``server_credentials()`` (TLS, and a client certificate signed by the CA is required);
the router dials workers with ``channel_credentials()`` and ``CHANNEL_OPTIONS`` (the name checked is
``CLUSTER_TLS_NAME``, not the worker's address, which is often an IP chosen at run time).

Trust model: every member of the cluster plane presents the same certificate, so TLS here proves "a member of
this cluster" (what the cluster secret proves) and adds encryption and integrity; it does not tell one worker
from another. The cluster secret stays on as well. The KV data plane (gloo, NCCL) has no TLS: docs/security.md
says how to fence it.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Optional

import grpc

from transport.tls import read_pem

CLUSTER_TLS_NAME = "pdserve-cluster.internal"
"""The DNS name in the cluster certificate and the name the router checks (``grpc.ssl_target_name_override``)."""
CHANNEL_OPTIONS = [("grpc.ssl_target_name_override", CLUSTER_TLS_NAME)]


@dataclass(frozen=True)
class ClusterTls:
    """The cluster CA bundle, and the certificate and key every member of the cluster plane presents (PEM)."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes = field(repr=False)

    def server_credentials(self) -> grpc.ServerCredentials:
        """A worker's: TLS with the cluster certificate, requiring a client certificate the CA signed."""
        return grpc.ssl_server_credentials(((self.key_pem, self.cert_pem),), root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """The router's: trust only the cluster CA, present the cluster certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)


def from_files(ca: Optional[str], cert: Optional[str], key: Optional[str]) -> ClusterTls:
    """Read the three PEM files (``--cluster-ca``, ``--cluster-cert``, ``--cluster-key``); ValueError naming the
    flag that is missing or unreadable, or a certificate the CA did not sign."""
    given = {"--cluster-ca": ca, "--cluster-cert": cert, "--cluster-key": key}
    missing = [f for f, p in given.items() if not p]
    if missing:
        raise ValueError(f"{', '.join(missing)}: the cluster's mutual TLS needs --cluster-ca, --cluster-cert and "
                         f"--cluster-key together")
    tls = ClusterTls(read_pem("--cluster-ca", ca), read_pem("--cluster-cert", cert),  # type: ignore[arg-type]
                     read_pem("--cluster-key", key))  # type: ignore[arg-type]
    check(tls)
    return tls


def check(tls: ClusterTls) -> None:
    """ValueError unless the certificate parses, names ``CLUSTER_TLS_NAME``, matches the key and the CA signed it."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(tls.cert_pem)
        cas = x509.load_pem_x509_certificates(tls.ca_pem)
        key = serialization.load_pem_private_key(tls.key_pem, password=None)
    except ValueError as e:
        raise ValueError(f"cluster TLS: a PEM file does not parse ({e})") from None
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
    except x509.ExtensionNotFound:
        names = []
    if CLUSTER_TLS_NAME not in names:
        raise ValueError(f"--cluster-cert: its subjectAltName must include DNS:{CLUSTER_TLS_NAME} (the name the "
                         f"router checks), has {names}")
    pub = lambda k: k.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if pub(key.public_key()) != pub(cert.public_key()):
        raise ValueError("--cluster-key is not the key of --cluster-cert")
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return
        except (ValueError, TypeError, InvalidSignature):  # issuer or signature mismatch: try the next CA
            continue
    raise ValueError("--cluster-cert was not issued by any certificate in --cluster-ca")


def generate(days: int = 3650) -> ClusterTls:
    """A fresh CA and cluster certificate (ECDSA P-256) for one run, as ``pdserve up --cluster-tls`` makes."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve cluster CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CLUSTER_TLS_NAME)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(CLUSTER_TLS_NAME)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return ClusterTls(ca.public_bytes(pem), cert.public_bytes(pem),
                      key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
