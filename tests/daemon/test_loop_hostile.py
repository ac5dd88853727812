"""The supervisor's run loop survives hostile frames on its sockets, for real.

A real ``SupervisorLoop`` (real Supervisor, real ControlServer, real heartbeat PULL over
ipc, real signal handling) whose children are real sleeping processes: a thread sends it
frames of every bad shape on the heartbeat socket and on the control ROUTER (deep nesting,
wrong types, huge length prefixes, random bytes, oversized and multipart messages, wrong
frame counts, a heartbeat whose thread ids overflow a pid), then a good heartbeat, which
must still turn engine 0 to running, and a good admin request, which must still be
answered. Then SIGTERM ends the loop the ordinary way."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import stat
import sys
import threading
import time

import msgspec
import pytest
import zmq

from planaria.common.envelope import ErrorCode, decode_reply
from planaria.daemon import config as config_mod
from planaria.daemon.children import PopenSpawner
from planaria.daemon.commands._common import admin_modules
from planaria.daemon.control import ControlClient, ControlServer, control_socket_path
from planaria.daemon.launch import HEARTBEAT_SOCKET, heartbeat_address
from planaria.daemon.loop import HEARTBEAT_MAX_BYTES, SupervisorLoop, command_handler
from planaria.daemon.supervisor import Supervisor
from planaria.engine.heartbeat import Heartbeat, encode

pytestmark = pytest.mark.timeout(120)

DEEP = 20_000  # past the recursion limit, and under HEARTBEAT_MAX_BYTES (3 bytes a level at most)
ENC = msgspec.msgpack.Encoder()


class SleeperSpawner:
    """Every child a real process that sleeps (so the loop watches real pidfds); the specs'
    command lines are not run."""

    def spawn(self, spec):
        argv = [sys.executable, "-c", "import time; time.sleep(600)"]
        return PopenSpawner().spawn(dataclasses.replace(spec, argv=argv, env={}, log_path=None, cwd=None))


def hostile_heartbeats(engine_pid: int) -> list[bytes]:
    rng = random.Random(6)
    fields = {"engine_index": 0, "pid": engine_pid, "step_counter": 0, "has_work": False}
    return [
        b"\x91" * DEEP + b"\xc0",                                       # [[[...[nil]...]]]
        b"\x81\xa1x" + b"\x91" * DEEP + b"\xc0",                        # {"x": [[[...]]]}: an unknown field
        b"\x81\xa1x" * DEEP + b"\xc0",                                  # {"x": {"x": ...}}
        ENC.encode({"engine_index": "zero", "pid": [], "step_counter": {}, "has_work": 1.5,
                    "state": None}),                                    # wrong types
        b"\xdb\xff\xff\xff\xff",                                        # str32 of 4 GiB, no bytes
        b"\xdd\xff\xff\xff\xff" + b"\xc0",                              # array32 of 4G items
        b"\xdf\xff\xff\xff\xff",                                        # map32
        b"\xc6\xff\xff\xff\xff" + b"x" * 10,                            # bin32
        b"\x85" + b"\xa1x\xc0" * 3,                                     # a map cut short
        b"",
        *(rng.randbytes(n) for n in (1, 7, 64, 1000, 20000)),
    ]


def strange_heartbeats(engine_pid: int) -> list[bytes]:
    """Heartbeats that decode, with values no engine sends."""
    fields = {"engine_index": 0, "pid": engine_pid, "has_work": False, "state": "starting"}
    return [
        ENC.encode({**fields, "step_counter": 0, "extra": [[[[[[1]]]]]] * 50}),
        ENC.encode({**fields, "step_counter": 2**64 - 1, "kv_usage": float("nan")}),
        ENC.encode({**fields, "engine_index": -(2**63), "step_counter": 0}),
        # the right engine and pid, thread ids no pid can be: os.pidfd_open overflows
        encode(Heartbeat(**fields, step_counter=0, exit_sentinel_tids=[2**40, -1, 2**63])),
    ]


def hostile_requests() -> list[list[bytes]]:
    """As a DEALER sends them (the ROUTER puts the identity in front)."""
    request = {"type": "request", "id": "h", "command": "status"}
    return [
        [b"", b"\x91" * DEEP + b"\xc0"],
        [b"", ENC.encode({**request, "args": {}})[:-1] + b"\x81\xa1a" + b"\x91" * DEEP + b"\xc0"],
        [b"", ENC.encode({**request, "args": {"a": [[[[[[[[1]]]]]]]] * 40}})],
        [b"", ENC.encode({"type": "request", "id": 5, "command": [], "args": "no"})],
        [b"", ENC.encode({**request, "command": "scale", "args": {"engines": "many"}})],
        [b"", ENC.encode({**request, "command": "restart", "args": {"engine_id": 2**63}})],
        [b"", b"\xdb\xff\xff\xff\xff"],
        [b"", b"\xdd\xff\xff\xff\xff"],
        [b"", random.Random(7).randbytes(5000)],
        [b"", b""],
        [b"not empty", ENC.encode(request)],                           # wrong delimiter
        [ENC.encode(request)],                                          # no delimiter
        [b"", ENC.encode(request), b"more"],                            # 4 frames
        [b""] * 100,                                                    # 100 frames
    ]


def attack(runtime_dir, hb_address, result: dict) -> None:
    """The hostile client; always ends the loop with SIGTERM."""
    ctx = zmq.Context()
    try:
        client = ControlClient(runtime_dir, timeout_s=10.0)
        deadline = time.monotonic() + 30
        while True:
            engine = client.call("status")["engines"][0]
            if engine["pid"] is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        pid = engine["pid"]

        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 2000)
        push.connect(hb_address)
        for frame in hostile_heartbeats(pid) + strange_heartbeats(pid):
            push.send(frame)
        push.send_multipart([b"\x91" * DEEP + b"\xc0", b"\x00\x01", b"\xdb\xff\xff\xff\xff"])
        big = ctx.socket(zmq.PUSH)  # over MAXMSGSIZE: ZMQ drops it and this connection
        big.setsockopt(zmq.LINGER, 0)
        big.connect(hb_address)
        big.send(b"\x91" * (HEARTBEAT_MAX_BYTES * 2))

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"ipc://{control_socket_path(runtime_dir)}")
        requests = hostile_requests()
        for frames in requests:
            dealer.send_multipart(frames)
        replies = []
        while dealer.poll(1500):
            frames = dealer.recv_multipart()
            assert len(frames) == 2 and frames[0] == b""
            replies.append(decode_reply(frames[1]))
        result["replies"] = replies

        oversized = ctx.socket(zmq.DEALER)
        oversized.setsockopt(zmq.LINGER, 0)
        oversized.connect(f"ipc://{control_socket_path(runtime_dir)}")
        oversized.send_multipart([b"", ENC.encode({"type": "request", "id": "big", "command": "status",
                                                   "args": {"pad": "x" * (2 << 20)}})])
        result["oversized_answered"] = bool(oversized.poll(1500))

        # still alive: a good heartbeat turns engine 0 to running, a good request is answered
        push.send(encode(Heartbeat(engine_index=0, pid=pid, step_counter=7, has_work=False,
                                   state="running", kv_source="profiled")))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            engine = client.call("status")["engines"][0]
            if engine["state"] == "running":
                break
            time.sleep(0.05)
        result["engine"] = engine
        result["hb_mode"] = stat.S_IMODE(os.stat(runtime_dir / HEARTBEAT_SOCKET).st_mode)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result["error"] = exc
    finally:
        ctx.destroy(linger=0)
        os.kill(os.getpid(), signal.SIGTERM)  # the loop's own handler: a clean stop


def test_the_loop_survives_hostile_frames_and_still_serves(tmp_path):
    runtime_dir = tmp_path / "run"
    config = config_mod.build({"model": str(tmp_path), "num_engines": 1, "state_dir": str(tmp_path / "s"),
                               "runtime_dir": str(runtime_dir), "stopped_timeout_s": 0.0,
                               "hang_timeout_s": 60.0, "stop_timeout_s": 5.0}, environ={})
    supervisor = Supervisor(config, SleeperSpawner(), time.monotonic)
    control = ControlServer(runtime_dir, command_handler(supervisor, admin_modules()))
    loop = SupervisorLoop(supervisor, control, heartbeat_address(config), ctx=zmq.Context())
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    result: dict = {}
    attacker = threading.Thread(target=attack, args=(runtime_dir, heartbeat_address(config), result))
    crashed = None
    try:
        loop.install_signal_handlers()
        attacker.start()
        try:
            code = loop.run()
        except BaseException as exc:  # noqa: BLE001 - the old loop died on a frame
            crashed = exc
    finally:
        attacker.join(60)  # the loop's handler stays installed until its SIGTERM has come
        loop.close()
        control.close()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for child in supervisor.live_children():
            child.send_signal(signal.SIGKILL)
            child.popen.wait(10)
    assert crashed is None, f"the loop died: {crashed!r}"
    assert "error" not in result, result["error"]
    assert code == 0
    assert result["engine"]["state"] == "running" and result["engine"]["step_counter"] == 7, result["engine"]
    # every undecodable frame counted (3 more in the multipart message); the oversized one
    # never arrived; the strange ones were handled without error
    assert loop.num_bad_heartbeats == len(hostile_heartbeats(1)) + 3
    # well-framed requests are answered (BAD_ARGUMENT, the command's own error, or Ok for a
    # status with an argument it ignores), the rest dropped
    replies = result["replies"]
    assert len(replies) == 10, replies
    codes = [getattr(r, "code", "ok") for r in replies]
    assert [codes[i] for i in (0, 1, 3, 6, 7, 8, 9)] == [ErrorCode.BAD_ARGUMENT] * 7, codes
    assert codes[2] == "ok" and codes[4] is not None and codes[5] is not None, codes
    assert control.num_malformed == 7 + 4
    assert not result["oversized_answered"]  # over MAXMSGSIZE: never delivered
    assert result["hb_mode"] == 0o600
