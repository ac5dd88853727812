"""etcd with TLS (client certificates required) and user/password auth, for real: the
bundled etcd started with certificates made by openssl, auth enabled with etcdctl, and a
short token TTL so that tokens expire during the test."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planaria.elastic.election import LeaderElection
from planaria.elastic.epochs import EpochStore
from planaria.elastic.errors import EtcdAuthError, EtcdUnavailableError
from planaria.elastic.etcd_client import etcd_call, make_client, num_authentications
from planaria.elastic.etcd_security import EtcdSecurity
from planaria.elastic.keys import NodeInfo
from planaria.elastic.membership import Membership
from tests.elastic.conftest import _require_etcd, wait_for
from tests.elastic.pki import make_pki, secure_etcd
from tests.elastic.test_election import make_epoch

USER, PASSWORD = "planaria", "s3cret-Pw"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    made = make_pki(tmp_path_factory.mktemp("pki"))
    if made is None:
        pytest.skip("no openssl command")
    return made


@pytest.fixture(scope="module")
def etcd(pki, tmp_path_factory):
    _require_etcd()
    server, password_file = secure_etcd(tmp_path_factory.mktemp("secure-etcd"), pki, USER, PASSWORD,
                                        token_ttl_s=2)
    server.password_file = password_file
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def good(pki, etcd) -> EtcdSecurity:
    return EtcdSecurity(ca_cert=pki.ca, cert=pki.client_cert, key=pki.client_key, user=USER,
                        password_file=etcd.password_file).validate()


def test_membership_and_election_with_tls_and_password(etcd, good, cluster):
    members = [Membership.from_endpoints(etcd.endpoint, cluster, f"n{i}", ttl_s=2, security=good).start()
               for i in range(2)]
    elections = [LeaderElection(m) for m in members]
    try:
        for m in members:
            m.register_node(NodeInfo(node_id=m.node_id, host="127.0.0.1", started_at=time.time()))
        assert sorted(n.node_id for n in members[0].list_nodes()) == ["n0", "n1"]
        won = [e.campaign() for e in elections]
        assert won == [True, False]
        assert [e.is_leader for e in elections] == [True, False]
        store = EpochStore(members[0].client, cluster)
        store.write_epoch(make_epoch(1, ["e0"], "n0"), 0, elections[0].leader_revision)
        assert store.read_epoch()[0].leader == "n0"
        # The leader's lease is kept alive across token expiries (TTL 2 s): still leader,
        # still able to write, having authenticated again.
        time.sleep(4.5)
        assert elections[0].is_leader and members[0].has_valid_lease
        epoch, rev = store.read_epoch()
        store.write_epoch(make_epoch(2, ["e0", "e1"], "n0"), rev, elections[0].leader_revision)
        # Leadership moves over a secured etcd too.
        elections[0].resign()
        elections[1].start()
        assert wait_for(lambda: elections[1].is_leader, timeout_s=5)
    finally:
        elections[1].stop()
        for m in members:
            m.close()


def test_an_expired_token_is_renewed(etcd, good, cluster):
    client = make_client(etcd.endpoint, security=good)
    try:
        with etcd_call("put"):
            client.put(f"/planaria/{cluster}/x", "1")
        assert num_authentications(client) == 1
        time.sleep(3.0)  # idle past the 2 s token TTL: etcd forgets the token
        with etcd_call("get"):
            assert client.get(f"/planaria/{cluster}/x")[0] == b"1"
        assert num_authentications(client) == 2
    finally:
        client.close()


def test_wrong_password_is_a_clear_error(etcd, pki, tmp_path, cluster):
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    bad = EtcdSecurity(ca_cert=pki.ca, cert=pki.client_cert, key=pki.client_key, user=USER,
                       password_file=str(wrong))
    m = Membership.from_endpoints(etcd.endpoint, cluster, "n0", ttl_s=2, security=bad)
    try:
        with pytest.raises(EtcdAuthError, match=f"refused the credentials of user '{USER}'.*authentication failed"):
            m.ensure_lease()
        with pytest.raises(EtcdAuthError):
            m.register_node(NodeInfo(node_id="n0", host="127.0.0.1"))
    finally:
        m.close(revoke=False)


@pytest.mark.parametrize("case", ["no user", "no client certificate", "another CA", "plaintext",
                                  "outside /planaria/"])
def test_missing_or_wrong_credentials_are_refused_clearly(etcd, pki, good, cluster, case):
    sec = {"no user": EtcdSecurity(ca_cert=pki.ca, cert=pki.client_cert, key=pki.client_key),
           "no client certificate": EtcdSecurity(ca_cert=pki.ca, user=USER, password_file=good.password_file),
           "another CA": EtcdSecurity(ca_cert=pki.other_ca, cert=pki.client_cert, key=pki.client_key,
                                      user=USER, password_file=good.password_file),
           "plaintext": EtcdSecurity(user=USER, password_file=good.password_file),
           "outside /planaria/": good}[case]
    key = "/elsewhere/x" if case == "outside /planaria/" else f"/planaria/{cluster}/x"
    client = make_client(etcd.endpoint, security=sec)
    try:
        with pytest.raises(EtcdUnavailableError) as info:
            with etcd_call("put"):
                client.put(key, "1")
    finally:
        client.close()
    text = str(info.value)
    if case in ("no user", "outside /planaria/"):
        assert isinstance(info.value, EtcdAuthError) and "permission denied" in text
    elif case in ("no client certificate", "another CA"):
        assert "TLS handshake refused" in text, text
    else:
        assert not isinstance(info.value, EtcdAuthError) and "UNAVAILABLE" in text


_ENGINE_LIKE = """
import sys, time
from planaria.elastic.etcd_security import EtcdSecurity
from planaria.elastic.keys import NodeInfo
from planaria.elastic.membership import Membership
endpoint, cluster = sys.argv[1:3]
m = Membership.from_endpoints(endpoint, cluster, "engine-like", ttl_s=2,
                              security=EtcdSecurity.from_env().validate()).start()
m.register_node(NodeInfo(node_id="engine-like", host="127.0.0.1"))
print("REGISTERED", flush=True)
sys.stdin.read()
m.close()
"""


def test_a_child_process_takes_the_credentials_from_its_environment(etcd, good, cluster):
    """What the EP engine processes do (elastic/ep_proc.py): TLS files, user and password
    file from PLANARIA_ETCD_*; the password is on no command line."""
    env = {**os.environ, **good.to_env(), "PYTHONPATH": str(REPO)}
    assert PASSWORD not in " ".join(env[k] for k in good.to_env())  # a path, not the secret
    proc = subprocess.Popen([sys.executable, "-c", _ENGINE_LIKE, etcd.endpoint, cluster], cwd=REPO, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        for line in proc.stdout:  # skip the log lines
            lines.append(line)
            if line.strip() == "REGISTERED":
                break
        assert lines and lines[-1].strip() == "REGISTERED", lines
        assert PASSWORD.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        client = make_client(etcd.endpoint, security=good)
        try:
            assert client.get(f"/planaria/{cluster}/nodes/engine-like")[0] is not None
        finally:
            client.close()
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_serve_config_passes_paths_to_the_engines(pki, good, tmp_path):
    from planaria.daemon import config as config_mod
    from planaria.daemon.launch import Launcher

    flags = {"model": str(tmp_path), "parallel": "ep", "etcd_endpoints": "127.0.0.1:1",
             "etcd_ca_cert": pki.ca, "etcd_cert": pki.client_cert, "etcd_key": pki.client_key,
             "etcd_user": USER, "etcd_password_file": good.password_file}
    cfg = config_mod.build(flags)
    launcher = Launcher(cfg)
    launcher.etcd_env = cfg.etcd_security().to_env()
    spec = launcher.engine(0)
    assert spec.env["PLANARIA_ETCD_PASSWORD_FILE"] == good.password_file
    assert spec.env["PLANARIA_ETCD_USER"] == USER and spec.env["PLANARIA_ETCD_CA_CERT"] == pki.ca
    assert not any(PASSWORD in a or good.password_file in a for a in spec.argv)
    with pytest.raises(config_mod.ConfigError, match="go together"):
        config_mod.build({**flags, "etcd_password_file": ""})
    with pytest.raises(config_mod.ConfigError, match="--etcd-endpoints"):
        config_mod.build({**flags, "etcd_endpoints": ""})
    with pytest.raises(config_mod.ConfigError, match="not a readable file"):
        config_mod.build({**flags, "etcd_ca_cert": str(tmp_path / "missing.pem")})
