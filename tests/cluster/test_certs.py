"""`shoal cluster certs` and reading a --cluster-tls directory back."""

from __future__ import annotations

import ipaddress
import os
import stat

import pytest
from cryptography import x509

from shoal.cli.app import main
from shoal.cluster.certs import CertsExist, make_cluster_certs
from shoal.cluster.tls import read_cluster_tls, rank_key
from shoal.config import build_cluster_settings


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_certs_writes_a_ca_a_node_certificate_it_signs_and_a_private_secret(tmp_path, capsys):
    directory = tmp_path / "tls"
    assert main(["cluster", "certs", str(directory), "--host", "node-a",
                 "--host", "10.1.2.3"]) == 0
    printed = capsys.readouterr().out
    names = ("ca.pem", "ca-key.pem", "node.pem", "node-key.pem", "cluster.secret")
    assert sorted(p.name for p in directory.iterdir()) == sorted(names)
    assert all(name in printed for name in names) and "--cluster-tls" in printed
    for private in ("ca-key.pem", "node-key.pem", "cluster.secret"):
        assert mode(directory / private) == 0o600
    secret = (directory / "cluster.secret").read_bytes()
    assert len(secret) == 32 and secret.hex() not in printed

    ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    node = x509.load_pem_x509_certificate((directory / "node.pem").read_bytes())
    node.verify_directly_issued_by(ca)  # raises if the CA did not sign it
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not node.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    names_in_cert = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names_in_cert.get_values_for_type(x509.DNSName)) == {"localhost", "node-a"}
    assert set(names_in_cert.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address(a) for a in ("127.0.0.1", "::1", "10.1.2.3")}

    tls = read_cluster_tls(directory)
    assert tls.secret == secret and secret.hex() not in repr(tls)


def test_certs_refuse_to_replace_a_ca_unless_forced(tmp_path, capsys):
    first = make_cluster_certs(tmp_path)
    ca_before = (tmp_path / "ca.pem").read_bytes()
    with pytest.raises(CertsExist, match="--force"):
        make_cluster_certs(tmp_path)
    assert main(["cluster", "certs", str(tmp_path)]) == 1
    assert "already holds a cluster CA" in capsys.readouterr().err
    assert (tmp_path / "ca.pem").read_bytes() == ca_before
    second = make_cluster_certs(tmp_path, force=True)
    assert (tmp_path / "ca.pem").read_bytes() != ca_before
    assert [p.name for p in first.files] == [p.name for p in second.files]


def test_a_tls_directory_with_a_missing_or_foreign_file_is_refused_naming_it(tmp_path):
    good, other = tmp_path / "good", tmp_path / "other"
    make_cluster_certs(good)
    make_cluster_certs(other)
    with pytest.raises(ValueError, match="no such directory"):
        read_cluster_tls(tmp_path / "absent")
    (other / "node.pem").replace(good / "node.pem")
    with pytest.raises(ValueError, match=r"node\.pem is not signed by .*ca\.pem"):
        read_cluster_tls(good)
    (good / "node-key.pem").unlink()
    with pytest.raises(ValueError, match=r"cannot read .*node-key\.pem"):
        build_cluster_settings(tls_dir=str(good), env={})


def test_serve_with_an_unreadable_tls_file_stops_at_start_naming_it(tmp_path, capsys):
    make_cluster_certs(tmp_path)
    secret = tmp_path / "cluster.secret"
    secret.chmod(0)
    if os.access(secret, os.R_OK):  # root reads anything: take the file away instead
        secret.unlink()
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--cluster-tls", str(tmp_path), "--no-preload"])
    assert exit_info.value.code == 2
    assert "cluster.secret" in capsys.readouterr().err


def test_cluster_settings_with_tls(tmp_path):
    make_cluster_certs(tmp_path)
    settings = build_cluster_settings(env={"SHOAL_CLUSTER_TLS": str(tmp_path)})
    secret = (tmp_path / "cluster.secret").read_bytes()
    assert settings.tls is not None and settings.tls.secret == secret
    assert secret.hex() not in repr(settings)
    with pytest.raises(ValueError, match="every cluster endpoint is tls/"):
        build_cluster_settings(tls_dir=str(tmp_path), peers=["tcp/10.0.0.2:7447"], env={})
    with pytest.raises(ValueError, match="standalone"):
        build_cluster_settings(tls_dir=str(tmp_path), standalone=True, env={})


def test_the_ranks_key_comes_from_the_tls_secret_else_the_cluster_secret(tmp_path):
    make_cluster_certs(tmp_path)
    secret = (tmp_path / "cluster.secret").read_bytes()
    settings = build_cluster_settings(tls_dir=str(tmp_path), secret="s3cret", env={})
    assert settings.rank_key == rank_key(secret) and settings.rank_key not in repr(settings)
    assert build_cluster_settings(secret="s3cret", env={}).rank_key == rank_key(b"s3cret")
    assert build_cluster_settings(env={}).rank_key == ""  # ranks prove nothing, as before
    assert len(rank_key(secret)) == 64 and rank_key(secret) != rank_key(b"s3cret")
