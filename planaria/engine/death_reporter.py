"""``DeathReporter``: says ENGINE_CORE_DEAD to a frontend for an engine that could not.

A dying engine sends ENGINE_CORE_DEAD itself (engine/proc.py), but a SIGKILLed one sends
nothing: whoever watches the engine process (the supervisor's loop, daemon/loop.py; the
test and bench deployment, tests/elastic/_deployment.py) sends it in its place, on a PUSH
socket connected to the frontend's PULL, as engine/wire.py describes. It lives in the
engine package, below both daemon and elastic, because it speaks the engine's wire.
"""

from __future__ import annotations

import time

import zmq

from planaria.common.logging import get_logger
from planaria.engine.wire import EngineDead, MsgType, WireEncoder

# The supervisor's loop sends these: its log lines keep the name they always had.
log = get_logger("planaria.loop")


class DeathReporter:
    """Sends ENGINE_CORE_DEAD for an engine to the frontend's PULL socket. Never blocks:
    ``IMMEDIATE`` means no queueing for a frontend that is not connected (it would
    otherwise deliver stale deaths to the next frontend)."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.address = address
        self._enc = WireEncoder(reuse_buffer=False)
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.SNDHWM, 64)
        self._sock.connect(address)

    def __call__(self, engine_id: int, pid: int | None, reason: str, cause: str = "",
                 suspects: list[str] | tuple = ()) -> bool:
        frames = self._enc.encode(MsgType.ENGINE_CORE_DEAD,
                                  EngineDead(engine_index=engine_id, reason=reason, pid=pid,
                                             # when we saw it die: a frontend does not count
                                             # the death against requests sent after it
                                             fault_monotonic_s=time.monotonic(), cause=cause,
                                             suspects=list(suspects)))
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("frontend not connected; ENGINE_CORE_DEAD not delivered",
                        engine_id=engine_id, pid=pid)
            return False
        log.info("reported engine death to the frontend", engine_id=engine_id, pid=pid,
                 reason=reason, sent_at=time.time(), **({"cause": cause} if cause else {}),
                 **({"suspects": list(suspects)} if suspects else {}))
        return True

    def close(self) -> None:
        self._sock.close(linger=0)
