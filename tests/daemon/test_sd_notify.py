"""sd_notify against real bound datagram sockets (a path in tmp_path, and abstract)."""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest

from planaria.daemon.sd_notify import Notifier, watchdog_interval_s


@pytest.fixture(params=["path", "abstract"])
def listener(request, tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(2.0)
    if request.param == "path":
        address = str(tmp_path / "notify.sock")
        sock.bind(address)
    else:
        name = f"planaria-test-{uuid.uuid4().hex}"
        sock.bind(b"\0" + name.encode())
        address = "@" + name
    yield address, sock
    sock.close()


def received(sock) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_messages(listener):
    address, sock = listener
    with Notifier(address) as notifier:
        assert notifier.enabled
        assert notifier.ready()
        assert received(sock) == ["READY=1"]
        assert notifier.ready(status="serving 2 engines")
        assert received(sock) == ["READY=1", "STATUS=serving 2 engines"]
        assert notifier.status("loading\nweights")
        assert received(sock) == ["STATUS=loading weights"]
        assert notifier.watchdog()
        assert received(sock) == ["WATCHDOG=1"]
        assert notifier.stopping()
        assert received(sock) == ["STOPPING=1"]
        assert notifier.extend_timeout(2.5)
        assert received(sock) == ["EXTEND_TIMEOUT_USEC=2500000"]
        before_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        assert notifier.reloading()
        lines = received(sock)
        after_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        assert lines[0] == "RELOADING=1"
        key, value = lines[1].split("=")
        assert key == "MONOTONIC_USEC" and before_usec <= int(value) <= after_usec


def test_from_environ_and_unset(listener):
    address, sock = listener
    env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1", "X": "y"}
    notifier = Notifier.from_environ(env, unset_environment=True)
    assert env == {"X": "y"}
    assert notifier.ready()
    assert received(sock) == ["READY=1"]
    notifier.close()


def test_disabled_without_notify_socket():
    notifier = Notifier.from_environ({})
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.watchdog() is False
    notifier.close()


def test_unsupported_address_disables():
    assert not Notifier("vsock:2:1234").enabled


def test_send_failure_returns_false(tmp_path):
    notifier = Notifier(str(tmp_path / "nobody-listens.sock"))
    assert notifier.enabled
    assert notifier.ready() is False
    notifier.close()


@pytest.mark.parametrize("env,pid,expected", [
    ({}, None, None),
    ({"WATCHDOG_USEC": "30000000"}, None, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, None, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 4242, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 4243, None),
    ({"WATCHDOG_USEC": "0"}, None, None),
    ({"WATCHDOG_USEC": "soon"}, None, None),
    ({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "me"}, None, None),
])
def test_watchdog_interval_s(env, pid, expected):
    assert watchdog_interval_s(env, pid=pid) == expected
