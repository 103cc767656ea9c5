"""Making a cluster's TLS material: a CA, one node certificate it signs, a cluster secret.

One node certificate serves every node (copy the same files to each machine): trust in the
cluster is "signed by this cluster's CA", which a per-node certificate would not change, as
every node holds a key the CA signed anyway. The certificate names localhost, 127.0.0.1, ::1
and the hosts asked for; nodes do not check names on connect (see cluster/tls.py).

Keys are ECDSA P-256, which rustls (Zenoh's TLS) accepts everywhere. Private keys and the
secret are written 0600 and never printed.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shoal.cluster.tls import (
    CA_CERT,
    CA_KEY,
    NODE_CERT,
    NODE_KEY,
    SECRET,
    SECRET_BYTES,
)

VALID_DAYS = 3650
_DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


class CertsExist(FileExistsError):
    """The directory already holds a CA; replacing it takes --force."""


@dataclass(frozen=True)
class WrittenCerts:
    """What make_cluster_certs wrote: every file, and the names the node cert carries."""

    directory: Path
    files: tuple[Path, ...]
    hosts: tuple[str, ...]


def make_cluster_certs(directory: Path, hosts: Sequence[str] = (),
                       force: bool = False) -> WrittenCerts:
    """A new CA, a node certificate for localhost plus `hosts` (names or IP addresses), and
    a random cluster secret in `directory`. CertsExist when a CA is there and not force."""
    directory.mkdir(parents=True, exist_ok=True)
    if not force and ((directory / CA_CERT).exists() or (directory / CA_KEY).exists()):
        raise CertsExist(f"{directory} already holds a cluster CA ({CA_CERT}); pass --force "
                         "to replace it (every node then needs the new files)")
    names = tuple(dict.fromkeys([*_DEFAULT_HOSTS, *(h.strip() for h in hosts if h.strip())]))
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _ca_certificate(ca_key, now)
    node_key = ec.generate_private_key(ec.SECP256R1())
    node_cert = _node_certificate(node_key, ca_key, ca_cert, names, now)
    written = (
        _write(directory / CA_KEY, _key_pem(ca_key), private=True),
        _write(directory / CA_CERT, ca_cert.public_bytes(serialization.Encoding.PEM)),
        _write(directory / NODE_KEY, _key_pem(node_key), private=True),
        _write(directory / NODE_CERT, node_cert.public_bytes(serialization.Encoding.PEM)),
        _write(directory / SECRET, secrets.token_bytes(SECRET_BYTES), private=True),
    )
    return WrittenCerts(directory, written, names)


def _ca_certificate(key: ec.EllipticCurvePrivateKey,
                    now: datetime.datetime) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shoal cluster CA")])
    public = key.public_key()
    return (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks a little apart
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256()))


def _node_certificate(key: ec.EllipticCurvePrivateKey, ca_key: ec.EllipticCurvePrivateKey,
                      ca_cert: x509.Certificate, hosts: Sequence[str],
                      now: datetime.datetime) -> x509.Certificate:
    public = key.public_key()
    ca_identifier = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "shoal node")]))
            .issuer_name(ca_cert.subject).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=False, crl_sign=False,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            # Every node both listens and dials: its certificate serves either side.
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
                ca_identifier.value), critical=False)
            .sign(ca_key, hashes.SHA256()))


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    # PKCS#8: the form rustls reads for every key type.
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    """path's new content, private files created 0600 (never briefly readable by others)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.unlink(missing_ok=True)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                         0o600 if private else 0o644)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)
    os.replace(temporary, path)
    return path
