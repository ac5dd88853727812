"""The embedded etcd's secured start, on the real etcd binary.

127.0.0.2 (a loopback alias) plays the outside address, with ``exposed=True``: the code
path of `serve --etcd-listen 10.0.0.1` on one machine. A prober hammers that address for
the whole first start: whatever connection it gets is already TLS only with auth on (no
anonymous user creation, no plain-text answer); afterwards a plain client is refused and an
https client with the daemon's CA works, also after the keeper restarted a killed etcd.
Users, roles or permissions the daemon did not make are found at the next start, which is
refused (EtcdAuditError) before anything listens outside."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import stat
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from etcd3 import etcdrpc

from planaria.daemon.etcd_keeper import EtcdKeeper, EtcdState
from planaria.elastic.errors import EtcdAuditError
from planaria.elastic.etcd_auth import audit_problems
from planaria.elastic.etcd_bootstrap import embedded_etcd
from planaria.elastic.etcd_client import etcd_call, make_client
from planaria.elastic.etcd_server import find_etcd_binary
from tests.elastic.conftest import wait_for

pytestmark = pytest.mark.timeout(180)
OUTSIDE = "127.0.0.2"


@pytest.fixture
def need_etcd_and_alias():
    if find_etcd_binary() is None or shutil.which("openssl") is None:
        pytest.skip("needs the etcd binary and openssl")
    try:
        with socket.socket() as s:
            s.bind((OUTSIDE, 0))
    except OSError:
        pytest.skip(f"{OUTSIDE} is not a local address here")


class Prober(threading.Thread):
    """Connects to ``port`` on the outside address again and again; on every connection it
    gets, tries to get in: an anonymous user over TLS (it knows the CA), a plain request."""

    def __init__(self, port: int, ca: bytes) -> None:
        super().__init__(daemon=True)
        self.port, self.ca = port, ca
        self.stop = threading.Event()
        self.num_accepted = 0
        self.intrusions: list[str] = []
        self.plain_codes: set[str] = set()

    def run(self) -> None:
        target = f"{OUTSIDE}:{self.port}"
        while not self.stop.is_set():
            try:
                socket.create_connection((OUTSIDE, self.port), timeout=0.2).close()
            except OSError:
                time.sleep(0.002)
                continue
            self.num_accepted += 1
            with grpc.secure_channel(target, grpc.ssl_channel_credentials(self.ca)) as channel:
                try:
                    etcdrpc.AuthStub(channel).UserAdd(etcdrpc.AuthUserAddRequest(name="intruder", password="x"),
                                                      timeout=1)
                    self.intrusions.append("added a user over TLS, anonymously")
                except grpc.RpcError:
                    pass
            with grpc.insecure_channel(target) as channel:
                try:
                    etcdrpc.KVStub(channel).Range(etcdrpc.RangeRequest(key=b"/"), timeout=1)
                    self.intrusions.append("read a key in plain text, anonymously")
                except grpc.RpcError as exc:
                    self.plain_codes.add(exc.code().name)


def _outside(tmp_path):
    return embedded_etcd(tmp_path / "etcd", OUTSIDE, exposed=True)


def test_first_exposed_start_is_tls_only_with_auth_on_before_anything_outside_connects(
        need_etcd_and_alias, tmp_path):
    emb = _outside(tmp_path)
    tls_dir = tmp_path / "etcd" / "tls"
    assert emb.exposed and emb.security.ca_cert == str(tls_dir / "ca.crt")
    assert stat.S_IMODE(tls_dir.stat().st_mode) == 0o700
    assert {stat.S_IMODE((tls_dir / k).stat().st_mode) for k in ("ca.key", "server.key")} == {0o600}
    ca = Path(emb.security.ca_cert).read_bytes()
    prober = Prober(emb.etcd.client_port, ca)
    prober.start()
    keeper = EtcdKeeper(emb.etcd, password=emb.security.password(), exposed=True)
    try:
        keeper.start()
        assert keeper.auth_enabled_at_start  # a fresh data dir: auth went on, on loopback
        assert wait_for(lambda: prober.num_accepted >= 3, 20), "the prober never got in touch"
        prober.stop.set()
        prober.join(10)
        assert prober.intrusions == [], prober.intrusions
        assert prober.plain_codes <= {"UNAVAILABLE"}, prober.plain_codes  # no plain-text answer at all

        base = f"{OUTSIDE}:{emb.etcd.client_port}"
        with pytest.raises(OSError):  # plain http: no answer (a TLS listener)
            urllib.request.urlopen(f"http://{base}/health", timeout=5).read()
        context = ssl.create_default_context(cafile=emb.security.ca_cert)
        with urllib.request.urlopen(f"https://{base}/health", timeout=5, context=context) as resp:
            assert b'"health":"true"' in resp.read()
        with pytest.raises(OSError):  # https without the daemon's CA: its certificate is not trusted
            urllib.request.urlopen(f"https://{base}/health", timeout=5, context=ssl.create_default_context())
        client = make_client(emb.etcd.endpoint, security=emb.security)  # https with the CA, as root
        try:
            with etcd_call("put"):
                client.put("/planaria/b/x", b"1")
            pid = keeper.pid
            os.kill(pid, signal.SIGKILL)  # the keeper's restart: straight to TLS, audited again
            assert wait_for(lambda: keeper.state is EtcdState.RUNNING and keeper.pid not in (None, pid), 60)
            with etcd_call("get"):
                assert client.get("/planaria/b/x")[0] == b"1"
        finally:
            client.close()
    finally:
        prober.stop.set()
        keeper.stop()


def test_an_unexpected_user_is_found_at_the_next_start_before_anything_listens_outside(
        need_etcd_and_alias, tmp_path):
    emb = _outside(tmp_path)
    password = emb.security.password()
    keeper = EtcdKeeper(emb.etcd, password=password, exposed=True).start()
    try:
        emb.etcd.ctl("user", "add", "mallory", "--new-user-password=m", user="root", password=password)
    finally:
        keeper.stop()
    prober = Prober(emb.etcd.client_port, Path(emb.security.ca_cert).read_bytes())
    prober.start()
    try:
        with pytest.raises(EtcdAuditError, match="unexpected user.s. mallory"):
            EtcdKeeper(emb.etcd, password=password, exposed=True).start()
    finally:
        prober.stop.set()
        prober.join(10)
    assert prober.num_accepted == 0  # found on loopback: the outside port never opened
    assert not emb.etcd.running


def test_loopback_start_audits_users_roles_and_permissions_every_time(need_etcd_and_alias, tmp_path):
    emb = embedded_etcd(tmp_path / "etcd")  # the default: loopback, no TLS
    assert not emb.exposed and emb.etcd.tls is None and not emb.security.ca_cert
    password = emb.security.password()
    keeper = EtcdKeeper(emb.etcd, password=password).start()
    try:
        keeper.stop()
        keeper = EtcdKeeper(emb.etcd, password=password).start()  # a clean restart passes its audit
        for args in (("role", "add", "spy"), ("role", "grant-permission", "spy", "read", "/planaria/"),
                     ("user", "add", "eve", "--new-user-password=e"), ("user", "grant-role", "eve", "spy"),
                     ("role", "grant-permission", "root", "readwrite", "/x")):
            emb.etcd.ctl(*args, user="root", password=password)
    finally:
        keeper.stop()
    with pytest.raises(EtcdAuditError) as info:
        EtcdKeeper(emb.etcd, password=password).start()
    text = str(info.value)
    assert "unexpected user(s) eve" in text and "unexpected role(s) spy" in text, text
    assert "role root carries permissions [readwrite '/x']" in text, text
    assert not emb.etcd.running


@pytest.mark.parametrize("users, roles, user_roles, role_perms, expected", [
    (["root"], ["root"], {"root": ["root"]}, {"root": []}, []),
    (["root", "a"], ["root"], {"root": ["root"]}, {"root": []}, ["unexpected user(s) a"]),
    ([], [], {}, {}, ["missing user(s) root", "missing role(s) root"]),
    (["root"], ["root", "r"], {"root": ["root", "r"]}, {"root": []},
     ["unexpected role(s) r", "user root has roles [root, r], not [root]"]),
])
def test_audit_problems(users, roles, user_roles, role_perms, expected):
    assert audit_problems(users, roles, user_roles, role_perms) == expected


def test_exposed_is_decided_by_the_listen_address(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl")
    outside = embedded_etcd(tmp_path / "a", "10.0.0.1", 2379, advertise_host="10.0.0.1")
    assert outside.exposed and outside.etcd.tls is not None and outside.security.ca_cert
    assert "IP:10.0.0.1" in (tmp_path / "a" / "tls" / "server.ext").read_text()
    command = " ".join(outside.etcd.command())
    assert "--listen-client-urls https://10.0.0.1:2379" in command and "--listen-peer-urls http://127.0.0.1:" in command
    anywhere = embedded_etcd(tmp_path / "b", "0.0.0.0", 2379)
    assert anywhere.exposed and anywhere.etcd.endpoint == "127.0.0.1:2379"  # the daemon's own client
    command = " ".join(anywhere.etcd.command())
    assert "--listen-client-urls https://0.0.0.0:2379" in command
    assert "--advertise-client-urls https://127.0.0.1:2379" in command
    local = embedded_etcd(tmp_path / "c", "127.0.0.1")
    assert not local.exposed and local.etcd.tls is None and not (tmp_path / "c" / "tls").exists()
