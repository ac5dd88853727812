"""Engine -> supervisor heartbeats: step progress and load, on a PUSH socket of its own.

    engine PUSH -> supervisor PULL   HEARTBEAT (one msgspec struct per message, no type frame)

A thread of the engine process sends one ``Heartbeat`` every ``interval_s`` while the
engine runs. It reads the busy loop's counters without locks (plain ints and lengths
under the GIL), so a busy loop that is stuck still produces heartbeats, with a step
counter that does not move while ``has_work`` is true: that is what the supervisor's
hang detector looks for. A SIGSTOPped process sends nothing; the detector's last known
state ("has work, no progress") catches that too. Sends never block: with no supervisor
listening a heartbeat is dropped (``IMMEDIATE`` + ``SNDHWM`` 4 + ``NOBLOCK``).

Exit sentinels: the thread also starts ``NUM_EXIT_SENTINELS`` threads that block for the
life of the process and names their thread ids in every beat. The supervisor opens a
thread pidfd (``PIDFD_THREAD``, Linux 6.9+) on each: when the process is killed, its
threads exit at once, long before the kernel has torn down the address space and the
process pidfd fires (tens to hundreds of ms for an engine holding GBs of weights and KV
cache), so a SIGKILLed engine is reported dead in about a millisecond.
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
    dtype: str = ""  # the compute dtype and why, e.g. "bfloat16 (auto: CPU has amx_bf16)"
    # KV salvage (engine/kv_segment.py), since the process started: requests that came with
    # a dead or draining engine's KV and the blocks adopted; requests it handed over
    num_salvaged_requests: int = 0
    num_salvaged_blocks: int = 0
    num_handed_over: int = 0
    timestamp: float = 0.0  # the engine's time.time(), for logs only
    exit_sentinel_tids: list[int] = []  # threads that end only when the process does


NUM_EXIT_SENTINELS = 2
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Heartbeat)


def start_exit_sentinels(num: int = NUM_EXIT_SENTINELS) -> list[int]:
    """Start ``num`` daemon threads that wait for ever; returns their native thread ids.
    They end only when the process ends (exit or signal), which is what makes their
    exit a death sentinel. Two, so one of them is not the thread that tears down memory."""
    forever = threading.Event()
    threads = [threading.Thread(target=forever.wait, name=f"exit-sentinel-{i}", daemon=True)
               for i in range(num)]
    for t in threads:
        t.start()
    return [t.native_id for t in threads]


def encode(beat: Heartbeat) -> bytes:
    return _encoder.encode(beat)


def decode(frame: bytes) -> Heartbeat:
    """Raises ``msgspec.DecodeError``, and only that, for anything that is not a Heartbeat:
    also for an unknown field nested past the recursion limit (msgspec skips an unknown
    field's value recursively and raises ``RecursionError`` there)."""
    try:
        return _decoder.decode(frame)
    except msgspec.DecodeError:
        raise
    except RecursionError as exc:
        raise msgspec.DecodeError("heartbeat nested too deeply") from exc
    except Exception as exc:  # noqa: BLE001 - a frame of the wrong kind (not bytes-like), say
        raise msgspec.DecodeError(f"undecodable heartbeat: {type(exc).__name__}: {exc}") from exc


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
        self.exit_sentinel_tids: list[int] = []

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(self.address)
        if not self.exit_sentinel_tids:
            self.exit_sentinel_tids = start_exit_sentinels()
        try:
            while True:
                try:
                    beat = self.snapshot()
                    beat.exit_sentinel_tids = self.exit_sentinel_tids
                    sock.send(encode(beat), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no supervisor connected: heartbeats are not worth queueing
                except Exception:  # a snapshot bug must not kill the thread silently
                    log.exception("heartbeat failed")
                if self._stop_event.wait(self.interval_s):
                    return
        finally:
            sock.close(linger=0)
