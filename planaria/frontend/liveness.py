"""The frontend's liveness beats, sent by its event loop itself (common/liveness.py has
the channel: the ``Beat`` message and how the supervisor tells who sent one).

A task on the frontend's asyncio loop sends one ``Beat`` every ``interval_s`` to the
supervisor's ``--liveness-address``. That is the point: a thread would keep beating while
the loop that serves HTTP is frozen (a CPU-bound handler, a blocking call, a deadlock); a
task cannot, so a silence means the loop did not run. The supervisor judges the silences
(daemon/frontend_watch.py) and kills a frontend whose loop stays silent for
``--frontend-hang-timeout-s``. Sends never block: with no supervisor listening a beat is
dropped (``IMMEDIATE`` + ``SNDHWM`` 4 + ``NOBLOCK``), as engine heartbeats are.

Fault injection (tests only, with ``PLANARIA_FAULT_INJECTION=1``, as for engines):
``PLANARIA_FRONTEND_FREEZE_FILE=PATH`` makes the loop block in ``time.sleep`` for ever
once PATH exists; the file is removed first, so the restarted frontend serves normally
(a freeze after a fixed delay would freeze every restarted frontend too).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Callable

import zmq

from planaria.common.liveness import Beat, EngineRouting, RoutingSummary, encode
from planaria.engine.envs import FAULT_INJECTION

log = logging.getLogger("frontend")

FREEZE_FILE = "PLANARIA_FRONTEND_FREEZE_FILE"
FREEZE_POLL_S = 0.1


async def send_beats(address: str, interval_s: float,
                     routing: Callable[[], RoutingSummary | None] | None = None) -> None:
    """Push a Beat to ``address`` every ``interval_s``, from this event loop, until
    cancelled; ``routing()`` gives the router's figures each beat carries (none: None)."""
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect(address)
    loop = asyncio.get_running_loop()
    pid = os.getpid()
    due = loop.time()
    try:
        for seq in itertools.count():
            now = loop.time()
            try:
                sock.send(encode(Beat(pid=pid, seq=seq, lag_s=round(max(0.0, now - due), 4),
                                      timestamp=time.time(), routing=_routing_of(routing))), zmq.NOBLOCK)
            except zmq.Again:
                pass  # no supervisor connected: beats are not worth queueing
            due = now + interval_s
            await asyncio.sleep(interval_s)
    finally:
        sock.close(linger=0)
        ctx.term()


def _routing_of(routing: Callable[[], RoutingSummary | None] | None) -> RoutingSummary | None:
    """The figures for one beat; a failure to make them never stops the beats (logged)."""
    if routing is None:
        return None
    try:
        return routing()
    except Exception:  # noqa: BLE001 - a beat without figures beats no beat (a "hung" kill)
        log.exception("routing figures for the liveness beat failed")
        return None


def routing_summary(client) -> RoutingSummary:
    """The router's figures of an EngineClient, for the beats (`planaria status`)."""
    r = client.routing_status()
    return RoutingSummary(policy=r["policy"], decisions=r["decisions"], engines=[EngineRouting(
        int(i), e["state"], e["num_cached_blocks"], e["num_routed"], e["routed_prompt_tokens"],
        e["routed_cached_tokens"], e["num_routed_while_down"]) for i, e in r["engines"].items()])


async def freeze_when(path: Path) -> None:
    """Fault injection: once ``path`` exists, remove it and freeze this event loop for ever."""
    while not path.exists():
        await asyncio.sleep(FREEZE_POLL_S)
    path.unlink(missing_ok=True)
    log.warning("fault injection: freezing the event loop (%s)", FREEZE_FILE)
    while True:
        time.sleep(3600)  # blocks the loop: no beat, no HTTP answer


def start(address: str | None, interval_s: float, environ=os.environ,
          routing: Callable[[], RoutingSummary | None] | None = None) -> list[asyncio.Task]:
    """The beat task (when the supervisor gave an address) and, with fault injection on and
    ``PLANARIA_FRONTEND_FREEZE_FILE`` set, the freeze task. Keep the list: the loop holds
    tasks weakly."""
    tasks = [asyncio.create_task(send_beats(address, interval_s, routing), name="liveness")] if address else []
    if environ.get(FAULT_INJECTION) == "1" and environ.get(FREEZE_FILE):
        tasks.append(asyncio.create_task(freeze_when(Path(environ[FREEZE_FILE])), name="freeze"))
    return tasks
