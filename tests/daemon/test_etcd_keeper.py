"""The embedded etcd as a supervised child, for real: SIGKILLed, it is restarted (new pid)
on the same data directory and port, with its keys and auth; status says so; and it dies
with a daemon that is SIGKILLed (PR_SET_PDEATHSIG), leaving no orphan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from planaria.daemon.etcd_keeper import EtcdKeeper, EtcdState
from planaria.elastic.etcd_auth import root_credential
from planaria.elastic.etcd_client import etcd_call, make_client
from planaria.elastic.etcd_server import EmbeddedEtcd, find_etcd_binary
from tests.elastic.conftest import wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def keeper(tmp_path):
    if find_etcd_binary() is None:
        pytest.skip("no etcd binary")
    security = root_credential(tmp_path / "etcd")
    k = EtcdKeeper(EmbeddedEtcd(tmp_path / "etcd", name="planaria", die_with_parent=True),
                   password=security.password()).start()
    try:
        yield k, security
    finally:
        k.stop()


def test_sigkilled_etcd_comes_back_on_the_same_data_dir(keeper):
    k, security = keeper
    pid, endpoint = k.pid, k.endpoint
    assert k.status()["state"] == "running" and k.auth_enabled_at_start
    client = make_client(endpoint, security=security)
    try:
        with etcd_call("put"):
            client.put("/planaria/k/x", b"kept")
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: k.state is EtcdState.RUNNING and k.pid not in (None, pid), 60), k.status()
        s = k.status()
        assert s["restarts"] == 1 and s["endpoint"] == endpoint and s["last_exit"] == "killed by SIGKILL", s
        assert not k.auth_enabled_at_start  # auth was still on: the data dir is the same
        with etcd_call("get"):
            assert client.get("/planaria/k/x")[0] == b"kept"
    finally:
        client.close()
    new_pid = k.pid
    k.stop()
    assert k.status()["state"] == "stopped"
    assert not psutil.pid_exists(new_pid) or psutil.Process(new_pid).status() == psutil.STATUS_ZOMBIE


def test_etcd_dies_with_a_sigkilled_parent(tmp_path):
    if find_etcd_binary() is None:
        pytest.skip("no etcd binary")
    script = textwrap.dedent(f"""
        import sys, time
        from planaria.daemon.etcd_keeper import EtcdKeeper
        from planaria.elastic.etcd_server import EmbeddedEtcd
        k = EtcdKeeper(EmbeddedEtcd({str(tmp_path / 'etcd')!r}, die_with_parent=True)).start()
        print("PID", k.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        line = ""
        while not line.startswith("PID "):  # structlog's lines come first
            line = parent.stdout.readline()
            assert line, "the parent exited"
        etcd_pid = int(line.split()[1])
        assert psutil.pid_exists(etcd_pid)
        parent.kill()  # SIGKILL: no shutdown path runs
        parent.wait(10)
        assert wait_for(lambda: not psutil.pid_exists(etcd_pid), 20), "etcd outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
