"""The embedded etcd's root credential and auth, on a real etcd: the password file is made
once (0600) and reused; auth goes on; an unauthenticated client is refused, the credential's
is served, also after etcd is killed and restarted on the same data directory."""

from __future__ import annotations

import os
import stat

import pytest

from planaria.elastic.errors import EtcdAuthError
from planaria.elastic.etcd_auth import ROOT_USER, auth_enabled, enable_root_auth, root_credential
from planaria.elastic.etcd_client import etcd_call, make_client


def test_root_credential_is_made_once_private_and_reused(tmp_path):
    first = root_credential(tmp_path / "etcd")
    path = first.password_file
    assert first.user == ROOT_USER and len(first.password()) >= 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = root_credential(tmp_path / "etcd")
    assert again == first and again.password() == first.password()
    os.chmod(path, 0o644)  # loosened by someone: tightened again, password kept
    assert root_credential(tmp_path / "etcd").password() == first.password()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert root_credential(tmp_path / "other").password() != first.password()


def test_auth_on_refuses_anonymous_and_survives_an_etcd_restart(private_etcd, tmp_path):
    security = root_credential(tmp_path / "cred")
    assert not auth_enabled(private_etcd.endpoint)
    assert enable_root_auth(private_etcd.endpoint, security.password())
    assert not enable_root_auth(private_etcd.endpoint, security.password())  # idempotent
    authed = make_client(private_etcd.endpoint, security=security)
    anonymous = make_client(private_etcd.endpoint)
    try:
        with etcd_call("put"):
            authed.put("/planaria/t/x", b"1")
        with pytest.raises(EtcdAuthError), etcd_call("get"):
            anonymous.get("/planaria/t/x")
        private_etcd.kill()
        private_etcd.start()
        assert auth_enabled(private_etcd.endpoint)
        with etcd_call("get"):
            assert authed.get("/planaria/t/x")[0] == b"1"  # re-authenticates after the restart
        with pytest.raises(EtcdAuthError), etcd_call("put"):
            anonymous.put("/planaria/t/x", b"2")
    finally:
        authed.close()
        anonymous.close()
