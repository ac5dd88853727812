"""The embedded etcd's TLS files (elastic/etcd_pki.py), made with the openssl command: made
once and reused, private keys 0600 in a 0700 directory, the server certificate made again
(same CA) when the hosts it must name change, and an operator's own files left as they are."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from planaria.elastic.etcd_pki import server_tls, tls_hosts

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def test_made_once_private_and_renewed_for_new_hosts_with_the_same_ca(tmp_path):
    tls = server_tls(tmp_path / "tls", ["127.0.0.1", "10.0.0.1"])
    assert stat.S_IMODE((tmp_path / "tls").stat().st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tls.key).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "tls" / "ca.key").st_mode) == 0o600
    ca, cert = open(tls.ca, "rb").read(), open(tls.cert, "rb").read()
    again = server_tls(tmp_path / "tls", ["10.0.0.1"])  # a subset: nothing to make
    assert again == tls and open(tls.cert, "rb").read() == cert
    server_tls(tmp_path / "tls", ["127.0.0.1", "10.0.0.2"])  # --etcd-listen moved
    assert open(tls.ca, "rb").read() == ca and open(tls.cert, "rb").read() != cert
    assert "IP:10.0.0.2" in (tmp_path / "tls" / "server.ext").read_text()


def test_an_operators_own_files_are_used_as_they_are(tmp_path):
    directory = tmp_path / "tls"
    directory.mkdir()
    for name in ("ca.crt", "server.crt", "server.key"):
        (directory / name).write_text(name)
    tls = server_tls(directory, ["10.0.0.9"])
    assert [open(p).read() for p in (tls.ca, tls.cert, tls.key)] == ["ca.crt", "server.crt", "server.key"]
    assert not (directory / "ca.key").exists()


def test_hosts_name_loopback_the_listen_and_the_advertised_address():
    assert tls_hosts("10.0.0.1", "10.0.0.2") == ["127.0.0.1", "::1", "10.0.0.1", "10.0.0.2"]
    assert "127.0.0.1" in tls_hosts("0.0.0.0") and "0.0.0.0" not in tls_hosts("0.0.0.0")
