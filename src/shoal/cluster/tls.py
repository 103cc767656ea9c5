"""A --cluster-tls directory: the files `shoal cluster certs` writes, read and checked once.

    ca.pem          the cluster CA's certificate: the only issuer a node trusts
    ca-key.pem      the CA's private key; only `shoal cluster certs` needs it (keep it off
                    the nodes if you like)
    node.pem        the node certificate, signed by the CA, shared by every node
    node-key.pem    its private key
    cluster.secret  32 random bytes: ranks of an instance prove it to each other (HMAC)

Every node of a cluster gets the same files. Zenoh links are TLS with both sides showing a
certificate the CA signed (mutual TLS); names are not checked on connect, since every node
holds the same CA-signed key and a name would prove nothing more, while scouted addresses
would have to be listed in the certificate beforehand.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
NODE_CERT = "node.pem"
NODE_KEY = "node-key.pem"
SECRET = "cluster.secret"
SECRET_BYTES = 32
_MIN_SECRET_BYTES = 16


@dataclass(frozen=True)
class ClusterTls:
    """The files of a checked --cluster-tls directory, and the secret they hold."""

    directory: Path
    secret: bytes = field(repr=False)

    @property
    def ca_cert(self) -> Path:
        return self.directory / CA_CERT

    @property
    def node_cert(self) -> Path:
        return self.directory / NODE_CERT

    @property
    def node_key(self) -> Path:
        return self.directory / NODE_KEY


def read_cluster_tls(directory: Path) -> ClusterTls:
    """The directory's files, each readable and well formed, the node certificate signed by
    the CA; ValueError naming the file otherwise."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    directory = directory.expanduser()
    if not directory.is_dir():
        raise ValueError(f"--cluster-tls {directory}: no such directory (make one with "
                         "`shoal cluster certs DIR`)")
    ca = _parse(directory / CA_CERT, x509.load_pem_x509_certificate, "a PEM certificate")
    node = _parse(directory / NODE_CERT, x509.load_pem_x509_certificate, "a PEM certificate")
    _parse(directory / NODE_KEY, lambda data: load_pem_private_key(data, password=None),
           "an unencrypted PEM private key")
    try:
        node.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ValueError(f"{directory / NODE_CERT} is not signed by {directory / CA_CERT}: "
                         "both must come from the same `shoal cluster certs` run") from None
    secret = _read(directory / SECRET)
    if len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(f"{directory / SECRET} holds {len(secret)} bytes; a cluster secret "
                         f"needs at least {_MIN_SECRET_BYTES}")
    return ClusterTls(directory, secret)


def rank_key(secret: bytes) -> str:
    """The key ranks prove to each other (hex), from a cluster secret; "" for none. Derived,
    so the secret itself never leaves the node process."""
    if not secret:
        return ""
    return hmac.new(secret, b"shoal rank links v1", hashlib.sha256).hexdigest()


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise ValueError(f"--cluster-tls: cannot read {path}: "
                         f"{error.strerror or error}") from None


def _parse(path: Path, parse, what: str):
    data = _read(path)
    try:
        return parse(data)
    except (ValueError, TypeError):
        raise ValueError(f"--cluster-tls: {path} is not {what}") from None
