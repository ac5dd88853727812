"""frontend/liveness.py and common/liveness.py's sender check over real ZMQ ipc sockets:
beats come from the event loop (a blocked loop sends none), and the sender's pid is the
kernel's, so another process cannot answer for the frontend."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
import zmq

from planaria.common.liveness import Beat, decode, encode, sender_pid
from planaria.frontend import liveness

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pull(tmp_path):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/sv-fe"
    sock.bind(address)
    yield sock, address
    sock.close(linger=0)
    ctx.term()


def received(sock) -> list[tuple[Beat, int | None]]:
    """The beats waiting on ``sock``, each with its sender's pid as ``sender_pid`` finds it."""
    out = []
    while sock.poll(0):
        frame = sock.recv(copy=False)
        beat = decode(frame.bytes)
        out.append((beat, sender_pid(frame, beat)))
    return out


def test_a_blocked_event_loop_sends_no_beats(pull):
    sock, address = pull

    async def main():
        tasks = liveness.start(address, 0.05, environ={})
        await asyncio.sleep(0.5)
        time.sleep(1.0)  # the loop is frozen: the beat task cannot run
        await asyncio.sleep(0.3)
        for task in tasks:
            task.cancel()

    asyncio.run(main())
    got = received(sock)
    beats = [b for b, _pid in got]
    assert len(beats) >= 5
    assert {pid for _b, pid in got} == {os.getpid()}  # the kernel's pid: our own
    seqs = [b.seq for b in beats]  # the first may be dropped (not connected yet): never queued
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    gaps = [b.timestamp - a.timestamp for a, b in zip(beats, beats[1:])]
    assert sum(gap >= 0.9 for gap in gaps) == 1  # one silence: the freeze
    # and the beat after it knows how late it is
    assert max(b.lag_s for b in beats) >= 0.9


def test_a_beat_from_another_process_in_the_frontends_name_is_refused(pull):
    sock, address = pull
    code = ("import os, sys, time, zmq; from planaria.common.liveness import Beat, encode; "
            "c = zmq.Context(); s = c.socket(zmq.PUSH); s.connect(sys.argv[1]); "
            "s.send(encode(Beat(pid=int(sys.argv[2]), seq=0))); "
            "s.send(encode(Beat(pid=os.getpid(), seq=1))); "
            "time.sleep(0.5)")
    victim = os.getpid()  # the "frontend" it pretends to be
    proc = subprocess.Popen([sys.executable, "-c", code, address, str(victim)])
    try:
        assert sock.poll(20_000)
        frames = [sock.recv(copy=False) for _ in range(2)]
    finally:
        proc.wait(20)
    spoofed, honest = (decode(f.bytes) for f in frames)
    assert spoofed.pid == victim and sender_pid(frames[0], spoofed) is None
    assert sender_pid(frames[1], honest) == proc.pid


def test_freeze_injection_needs_fault_injection_and_is_one_shot(tmp_path):
    trigger = tmp_path / "freeze"

    async def tasks_for(environ):
        tasks = liveness.start(None, 1.0, environ=environ)
        names = [t.get_name() for t in tasks]
        for t in tasks:
            t.cancel()
        return names

    assert asyncio.run(tasks_for({liveness.FREEZE_FILE: str(trigger)})) == []
    assert asyncio.run(tasks_for({"PLANARIA_FAULT_INJECTION": "1",
                                  liveness.FREEZE_FILE: str(trigger)})) == ["freeze"]
