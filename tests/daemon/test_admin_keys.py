"""CurveZMQ key files for the remote admin socket, and the CLI's choice of client."""

from __future__ import annotations

import argparse
import os
import stat

import pytest

from planaria.daemon import admin_keys
from planaria.daemon.admin_keys import AdminKeyError
from planaria.daemon.commands import _common
from planaria.daemon.control import ControlClient


def test_make_keypair_writes_a_private_secret_and_refuses_to_overwrite(tmp_path):
    public, secret = admin_keys.make_keypair(tmp_path / "keys", "laptop")
    assert (public.name, secret.name) == ("laptop.key", "laptop.key_secret")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pub, sec = admin_keys.load_keypair(secret)
    assert admin_keys.load_public_key(public) == pub and len(sec) == 40
    with pytest.raises(AdminKeyError, match="not overwriting"):
        admin_keys.make_keypair(tmp_path / "keys", "laptop")
    with pytest.raises(AdminKeyError, match="bad key name"):
        admin_keys.make_keypair(tmp_path, "../x")


def test_load_errors_say_what_is_wrong(tmp_path):
    public, _secret = admin_keys.make_keypair(tmp_path, "c")
    with pytest.raises(AdminKeyError, match="does not exist"):
        admin_keys.load_public_key(tmp_path / "nope.key", "--server-key")
    with pytest.raises(AdminKeyError, match="holds no secret key"):
        admin_keys.load_keypair(public, "--client-key")
    junk = tmp_path / "junk.key"
    junk.write_text("not a certificate\n")
    with pytest.raises(AdminKeyError, match="not a ZeroMQ certificate"):
        admin_keys.load_public_key(junk)


def test_server_keypair_is_made_once_and_kept(tmp_path):
    keys_dir = tmp_path / "admin-keys"
    first = admin_keys.server_keypair(keys_dir)
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
    assert admin_keys.server_keypair(keys_dir) == first
    assert admin_keys.load_public_key(first[2]) == first[0]


def test_authorized_keys_need_one_and_are_read_at_each_connect(tmp_path):
    keys_dir = tmp_path / "admin-keys"
    with pytest.raises(AdminKeyError, match="planaria keygen NAME"):
        admin_keys.authorized_keys(keys_dir)
    pub_a, _ = admin_keys.make_keypair(keys_dir / "authorized", "a")
    provider = admin_keys.authorized_keys(keys_dir)
    key_a = admin_keys.load_public_key(pub_a)
    assert provider.callback("*", key_a)
    pub_b, _ = admin_keys.make_keypair(tmp_path / "elsewhere", "b")
    key_b = admin_keys.load_public_key(pub_b)
    assert not provider.callback("*", key_b)
    (keys_dir / "authorized" / "b.key").write_bytes(pub_b.read_bytes())  # added live
    (keys_dir / "authorized" / "stray.key").write_text("junk\n")  # ignored, locks no one out
    assert provider.callback("*", key_b) and provider.callback("*", key_a)
    os.remove(keys_dir / "authorized" / "a.key")  # revoked live
    assert not provider.callback("*", key_a)


def _args(**kw) -> argparse.Namespace:
    base = dict(runtime_dir=None, state_dir=None, timeout_s=1.0, connect=None,
                server_key=None, client_key=None)
    return argparse.Namespace(**{**base, **kw})


def test_cli_client_choice_and_clear_errors(tmp_path):
    server_pub, _ = admin_keys.make_keypair(tmp_path, "server")
    _, client_secret = admin_keys.make_keypair(tmp_path, "me")
    local = _common.client(_args(runtime_dir=str(tmp_path)))
    assert isinstance(local, ControlClient) and local.where.endswith("control.sock")
    remote = _common.client(_args(connect="tcp://127.0.0.1:7777", server_key=server_pub,
                                  client_key=client_secret))
    assert remote.where == "tcp://127.0.0.1:7777"
    cases = [
        (dict(connect="127.0.0.1:7777"), "wants tcp://HOST:PORT"),
        (dict(connect="tcp://127.0.0.1:7777"), "needs --server-key FILE"),
        (dict(connect="tcp://127.0.0.1:7777", server_key=server_pub), "needs --client-key FILE"),
        (dict(connect="tcp://127.0.0.1:7777", server_key=server_pub,
              client_key=tmp_path / "me.key"), "holds no secret key"),
        (dict(connect="tcp://127.0.0.1:7777", server_key=tmp_path / "none.key",
              client_key=client_secret), "does not exist"),
        (dict(connect="tcp://host-without-port", server_key=server_pub,
              client_key=client_secret), "host:port"),
        (dict(server_key=server_pub), "go with --connect"),
    ]
    for kw, text in cases:
        with pytest.raises(AdminKeyError, match=text):
            _common.client(_args(**kw))
        assert _common.fail("status", AdminKeyError(text)) == _common.EXIT_BAD_ARGUMENT
