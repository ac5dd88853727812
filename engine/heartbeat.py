"""Engine -> supervisor heartbeats: step progress and load, on a PUSH socket of its own.

    engine PUSH -> supervisor PULL   HEARTBEAT (one msgspec struct per message, no type frame)

A thread of the engine process sends one ``Heartbeat`` every ``interval_s`` while the
engine runs. It reads the busy loop's counters without locks (plain ints and lengths
under the GIL), so a busy loop that is stuck still produces heartbeats, with a step
counter that does not move while ``has_work`` is true: that is what the supervisor's
hang detector looks for. A SIGSTOPped process sends nothing; the detector's last known
state ("has work, no progress") catches that too. Sends never block: with no supervisor
listening a heartbeat is dropped (``IMMEDIATE`` + ``SNDHWM`` 4 + ``NOBLOCK``).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import msgspec
import zmq

log = logging.getLogger(__name__)


class Heartbeat(msgspec.Struct, kw_only=True, omit_defaults=True):
    engine_index: int
    pid: int
    step_counter: int
    has_work: bool
    state: str
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_cache_bytes: int = 0
    num_kv_blocks: int = 0
    kv_source: str = ""
    timestamp: float = 0.0  # the engine's time.time(), for logs only


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Heartbeat)


def encode(beat: Heartbeat) -> bytes:
    return _encoder.encode(beat)


def decode(frame: bytes) -> Heartbeat:
    """Raises ``msgspec.DecodeError`` for anything that is not a Heartbeat."""
    return _decoder.decode(frame)


class HeartbeatThread(threading.Thread):
    """Calls ``snapshot()`` every ``interval_s`` and pushes the result to ``address``."""

    def __init__(self, ctx: zmq.Context, address: str, interval_s: float,
                 snapshot: Callable[[], Heartbeat]) -> None:
        super().__init__(name="engine-heartbeat", daemon=True)
        self.address = address
        self.interval_s = interval_s
        self.snapshot = snapshot
        self._ctx = ctx
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(self.address)
        try:
            while True:
                try:
                    sock.send(encode(self.snapshot()), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no supervisor connected: heartbeats are not worth queueing
                except Exception:  # a snapshot bug must not kill the thread silently
                    log.exception("heartbeat failed")
                if self._stop_event.wait(self.interval_s):
                    return
        finally:
            sock.close(linger=0)
