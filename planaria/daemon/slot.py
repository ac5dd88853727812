"""A child slot of the supervisor (an engine id, or the frontend), its lifecycle, and the
process runs it has had.

The supervisor (daemon/supervisor.py) keeps one ``Slot`` per engine id and one for the
frontend. A slot outlives its processes (circus keeps its ``Watcher`` apart from each
``Process``): what spans restarts (key, state, restart count, the last exit reason,
backoff, the reused engine config) is the slot's, and what belongs to one process (pid,
start time, why the supervisor killed it, its heartbeat, ...) is its ``Incarnation``,
made at spawn (``Slot.begin``) and dropped whole when the process exits (``Slot.end``),
so nothing of one run is ever reset field by field or seen by the next.

``SlotState`` documents the transitions and ``AfterExit`` what a planned stop does once
the child has exited. ``ScaleOp`` is the scale operation in progress (the engines it
adds and removes).
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
    """What the supervisor does when a slot's child exits: set on the child's incarnation
    when the supervisor stops it (or, for REMOVE, marks an EP rank that leaves on its own
    at the scale-down epoch), so it goes with that process; a new process starts with
    UNPLANNED. The value is the text status, logs and error messages show ("engine 3 is
    already stopping (drain)").

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


@dataclass(slots=True, eq=False)
class Incarnation:
    """One process of a slot, from its spawn to its exit; never reused for the next one."""

    child: Child
    started_at: float
    kill_at: float | None = None       # STOPPING: when to SIGKILL
    after_exit: AfterExit = AfterExit.UNPLANNED  # what its exit means
    kill_reason: str = ""              # why the supervisor killed it (hung, ...)
    killed_stopped: bool = False       # the watchdog killed it while it was stopped (SIGSTOP)
    death_reported: bool = False       # ENGINE_CORE_DEAD sent early (exit sentinels)
    heartbeat: Any = None              # the engine's last engine.heartbeat.Heartbeat

    @property
    def pid(self) -> int:
        return self.child.pid


@dataclass(slots=True)
class Slot:
    key: Hashable
    state: SlotState = SlotState.WAITING
    current: Incarnation | None = None  # the running process (None: none)
    due_at: float | None = None        # BACKOFF: when to start again
    held: bool = False                 # BACKOFF under a flap hold (not coming back soon)
    reason: str = ""                   # last exit or hold-off, for status
    extra_config: dict[str, Any] = field(default_factory=dict)  # e.g. reused kv figure
    num_starts: int = 0                # spawns so far (a restarted engine reuses a KV figure)

    def begin(self, child: Child, now: float) -> Incarnation:
        """``child`` was spawned for this slot at ``now``: its run starts afresh."""
        if self.current is not None:
            raise RuntimeError(f"slot {self.key!r} already runs pid {self.current.pid}; "
                               f"a second process would go unwatched")
        self.current = Incarnation(child, now)
        return self.current

    def end(self) -> Incarnation:
        """The current process exited: its run is over and dropped; returns it."""
        run, self.current = self.current, None
        if run is None:
            raise RuntimeError(f"slot {self.key!r} has no process to end")
        return run

    @property
    def engine_id(self) -> int | None:
        return self.key[1] if self.key != FRONTEND_KEY else None

    @property
    def child(self) -> Child | None:
        return self.current.child if self.current is not None else None

    @property
    def pid(self) -> int | None:
        return self.current.pid if self.current is not None else None

    @property
    def after_exit(self) -> AfterExit:
        """What the running process's exit means (UNPLANNED with none running)."""
        return self.current.after_exit if self.current is not None else AfterExit.UNPLANNED


@dataclass
class ScaleOp:
    op_id: int
    target: int
    adding: list[int]
    removing: list[int]
