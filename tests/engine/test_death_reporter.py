"""DeathReporter: ENGINE_CORE_DEAD on a frontend's PULL socket, for an engine that could not
send it; never blocks when no frontend is there."""

from __future__ import annotations

import time

import zmq

from planaria.engine.death_reporter import DeathReporter
from planaria.engine.wire import EngineDead, MsgType, WireDecoder


def test_reports_an_engine_death_the_frontend_decodes(tmp_path):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    address = f"ipc://{tmp_path / 'out'}"
    pull.bind(address)
    report = DeathReporter(ctx, address)
    try:
        before_s = time.monotonic()
        # IMMEDIATE: the PUSH has no pipe until the connection is up
        deadline_s = before_s + 5.0
        while not report(3, 1234, "engine exited with -9", cause="external", suspects=("r1",)):
            assert time.monotonic() < deadline_s, "the PUSH never connected"
            time.sleep(0.01)
        assert pull.poll(5000)
        msg_type, dead = WireDecoder(frozenset({MsgType.ENGINE_CORE_DEAD})).decode(pull.recv_multipart())
        assert msg_type == MsgType.ENGINE_CORE_DEAD
        assert isinstance(dead, EngineDead)
        assert (dead.engine_index, dead.pid, dead.reason, dead.cause, dead.suspects) == (
            3, 1234, "engine exited with -9", "external", ["r1"])
        assert before_s <= dead.fault_monotonic_s <= time.monotonic()
    finally:
        report.close()
        pull.close(linger=0)
        ctx.term()


def test_no_frontend_connected_is_not_delivered_and_does_not_block(tmp_path):
    ctx = zmq.Context()
    report = DeathReporter(ctx, f"ipc://{tmp_path / 'nobody'}")
    try:
        t0 = time.monotonic()
        assert report(0, None, "engine exited with 1") is False
        assert time.monotonic() - t0 < 1.0
    finally:
        report.close()
        ctx.term()
