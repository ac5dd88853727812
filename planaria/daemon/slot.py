"""A child slot of the supervisor (an engine id, or the frontend) and its lifecycle.

The supervisor (daemon/supervisor.py) keeps one ``Slot`` per engine id and one for the
frontend; ``SlotState`` documents the transitions and ``AfterExit`` what a planned stop
does once the child has exited. ``ScaleOp`` is the scale operation in progress (the
engines it adds and removes).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Hashable

from planaria.daemon.children import Child
from planaria.daemon.launch import FRONTEND_KEY


class SlotState(str, enum.Enum):
    """Lifecycle of a child slot (an engine id, or the frontend), as the supervisor sees it.

    STARTING (spawned) -> RUNNING (engine: a heartbeat says it serves; frontend: an
    engine reached it); STARTING|RUNNING -> STOPPING (SIGTERM sent; SIGKILL after
    stop_timeout_s). On exit: planned restart -> STARTING; drain -> DRAINED; scale-down
    -> the slot is removed; shutdown -> STOPPED; otherwise a failure -> BACKOFF (restart
    due later, or flap hold-off) -> STARTING, or FAILED (retry limit reached). An engine
    whose frontend is down waits in WAITING and starts with the next frontend. DRAINED
    and FAILED engines start again on `planaria restart`.
    """

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    WAITING = "waiting"
    DRAINED = "drained"
    FAILED = "failed"
    STOPPED = "stopped"


class AfterExit(str, enum.Enum):
    """What the supervisor does when a slot's child exits: set when it stops the child
    (or, for REMOVE, marks an EP rank that leaves on its own at the scale-down epoch) and
    cleared back to UNPLANNED once the exit is handled. The value is the text status,
    logs and error messages show ("engine 3 is already stopping (drain)").

    UNPLANNED ("") nothing planned: the exit is a failure, the restart policy decides
      (BACKOFF, STARTING or FAILED); a frontend's failure takes its engines down too.
    RESTART  `planaria restart`: start the child again at once (STARTING).
    DRAIN    `planaria drain`: leave the engine stopped (DRAINED) until restarted.
    REMOVE   scale-down: delete the engine's slot (and its restart history).
    FRONTEND its frontend died: the engine waits (WAITING) and starts with the next one.
    STOP     daemon shutdown: the slot ends STOPPED.
    """

    UNPLANNED = ""
    RESTART = "restart"
    DRAIN = "drain"
    REMOVE = "remove"
    FRONTEND = "frontend"
    STOP = "stop"


@dataclass
class Slot:
    key: Hashable
    state: SlotState = SlotState.WAITING
    child: Child | None = None
    started_at: float | None = None
    due_at: float | None = None        # BACKOFF: when to start again
    held: bool = False                 # BACKOFF under a flap hold (not coming back soon)
    killed_stopped: bool = False       # the watchdog killed it while it was stopped (SIGSTOP)
    kill_at: float | None = None       # STOPPING: when to SIGKILL
    after_exit: AfterExit = AfterExit.UNPLANNED  # what its next exit means
    kill_reason: str = ""              # why the supervisor killed it (hung, ...)
    death_reported: bool = False       # ENGINE_CORE_DEAD sent early (exit sentinels)
    reason: str = ""                   # last exit or hold-off, for status
    extra_config: dict[str, Any] = field(default_factory=dict)  # e.g. reused kv figure
    heartbeat: Any = None              # the engine's last engine.heartbeat.Heartbeat
    num_starts: int = 0

    @property
    def engine_id(self) -> int | None:
        return self.key[1] if self.key != FRONTEND_KEY else None

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None else None


@dataclass
class ScaleOp:
    op_id: int
    target: int
    adding: list[int]
    removing: list[int]
