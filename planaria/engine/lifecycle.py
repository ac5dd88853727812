"""The lifecycle of an engine-core process: states, drain and recovery deadlines, exits.

Decide, then act: the process (engine/proc.py, elastic/ep_proc.py) reports what happened
(a signal, a SHUTDOWN, a fault, a "pause"/"resume"/"reset" call, a loop tick) and gets a
list of actions back, which it carries out (STATUS to the frontends, dropped requests,
ENGINE_CORE_DEAD, its exit). ``EngineLifecycle`` owns no queue, socket, thread or core,
and the clock is injected: every ``now`` is one monotonic clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Union

from planaria.engine.errors import EngineStateError

# Exit codes of an engine-core process (a supervisor reads them):
EXIT_OK = 0  # stopped: drained, aborted on request, or a signal during the handshake
EXIT_DEAD = 1  # fatal fault or failed start (ENGINE_CORE_DEAD was sent): a crash, restart it
EXIT_USAGE = 2  # bad command-line arguments or config
EXIT_HANDSHAKE = 3  # no frontend completed the handshake in time (or gave no output address)
# A frontend refused this engine (HANDSHAKE_REJECT: config hash or protocol version), or
# the engine refused a frontend's protocol version. A configuration error, not a crash:
# the same engine with the same settings is refused again, so do not restart it as is.
EXIT_CONFIG_MISMATCH = 4


class EngineExit(Exception):
    """Raised by a process carrying out a terminal action (Stop, Refused, Die) to leave
    its loop; ``code`` is the process exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class EngineState(str, enum.Enum):
    """Lifecycle of an engine-core process.

    STARTING -> RUNNING (READY sent); RUNNING <-> PAUSED ("pause"/"resume");
    RUNNING|PAUSED -> DRAINING (SIGTERM / SHUTDOWN) -> STOPPED (drained, exit 0);
    DRAINING -> STOPPED (second signal, SHUTDOWN with 0, or drain timeout: work aborted);
    any -> UNHEALTHY (engine-level fault) -> RUNNING ("reset"/"resume") | DEAD (exit 1).
    any -> STOPPED (a frontend sent HANDSHAKE_REJECT after READY: exit EXIT_CONFIG_MISMATCH).
    Expert parallelism: RUNNING -> UNHEALTHY (the rank's group failed; not announced, the
    rank keeps taking requests) -> RUNNING (re-formed at a new epoch) | DEAD (no new epoch
    within the re-form timeout); a rank re-forming from PAUSED keeps that state until it
    re-forms, then is RUNNING; a DRAINING one stays DRAINING (it leaves at the next epoch
    boundary, or at its drain deadline: ``on_leave_tick``).
    """

    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"
    STOPPED = "stopped"
    DEAD = "dead"


# -- actions --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SetState:
    """The state is now ``state``: drop every in-flight request first when
    ``drop_requests`` (the STATUS says whether there were any), then send STATUS."""

    state: EngineState
    reason: str = ""
    drop_requests: bool = False


@dataclass(frozen=True, slots=True)
class Stop:
    """Stopped (exit EXIT_OK). Aborted: the in-flight requests are dropped; the STOPPED
    status says so (requests_dropped) and why, and a frontend fails them with that reason."""

    aborted: bool
    cause: str = ""
    exit_code: ClassVar[int] = EXIT_OK

    @property
    def reason(self) -> str:
        if not self.aborted:
            return "shutdown (drained)"
        return f"shutdown{f' ({self.cause})' if self.cause else ''}: in-flight work aborted"


@dataclass(frozen=True, slots=True)
class Refused:
    """Frontend ``slot`` refused this engine after READY (config hash mismatch): drop every
    request, STOPPED status to all frontends, exit EXIT_CONFIG_MISMATCH."""

    slot: int
    reason: str
    exit_code: ClassVar[int] = EXIT_CONFIG_MISMATCH


@dataclass(frozen=True, slots=True)
class Die:
    """Dead (exit EXIT_DEAD): ENGINE_CORE_DEAD to every frontend. ``fault_monotonic_s``:
    when the fatal fault was caught, if a fault is the cause."""

    reason: str
    fault_monotonic_s: float | None = None
    exit_code: ClassVar[int] = EXIT_DEAD


@dataclass(frozen=True, slots=True)
class Step:
    """Run one step of the core."""


@dataclass(frozen=True, slots=True)
class Wait:
    """Take input: block for the first item until ``until`` (None: no limit; a time already
    past: do not block), then take whatever else has arrived."""

    until: float | None


@dataclass(frozen=True, slots=True)
class RollBack:
    """Roll back the batch a failed step left in flight (core.recover_after_fault)."""


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Empty the core's prefix cache."""


@dataclass(frozen=True, slots=True)
class Wake:
    """From the signal handler: wake the loop (a WAKEUP on the input queue)."""


@dataclass(frozen=True, slots=True)
class AbandonStart:
    """From the signal handler: a second signal while loading; exit EXIT_OK at once."""


@dataclass(frozen=True, slots=True)
class Signalled:
    """Signal ``number`` is being handled (the process logs it); actions follow."""

    number: int

    @property
    def draining(self) -> bool:
        return self.number == 1


Action = Union[SetState, Stop, Refused, Die, Step, Wait, RollBack, ResetPrefixCache, Wake, AbandonStart,
               Signalled]

_DRAIN_REFUSAL = "engine is draining (shutting down); send it elsewhere"
_CANNOT_RESET = (EngineState.DRAINING, EngineState.STOPPED, EngineState.DEAD)


class EngineLifecycle:
    """One engine process's state. Each ``on_*`` input, and ``pause``/``resume``/``reset``,
    changes the state and returns what the process must do, in order; a utility call that
    the state refuses raises EngineStateError (its caller gets it) and changes nothing.

    ``drain_timeout_s``: the drain of a first signal, or of a SHUTDOWN without one;
    ``recovery_timeout_s``: after an engine-level fault, how long "reset"/"resume" may come
    (0: die at once); ``keep_requests_on_fault``: keep in-flight requests across UNHEALTHY;
    ``reform_timeout_s`` (expert parallelism): how long a rank whose group failed waits
    for a new epoch (None: ``recovery_timeout_s``, or 120 s when that is 0)."""

    def __init__(self, drain_timeout_s: float = 30.0, recovery_timeout_s: float = 0.0,
                 keep_requests_on_fault: bool = False, reform_timeout_s: float | None = None) -> None:
        self.drain_timeout_s = drain_timeout_s
        self.recovery_timeout_s = recovery_timeout_s
        self.keep_requests_on_fault = keep_requests_on_fault
        self.reform_timeout_s = (recovery_timeout_s or 120.0) if reform_timeout_s is None else reform_timeout_s
        self.state = EngineState.STARTING
        self.deadline: float | None = None  # drain or recovery deadline
        self.fault_reason = ""
        self.num_signals = 0
        self.num_handled_signals = 0
        self.reforming = False  # expert parallelism: lost its group, waits for the next epoch
        self.reform_deadline: float | None = None

    @property
    def can_step(self) -> bool:
        return self.state in (EngineState.RUNNING, EngineState.DRAINING)

    # -- start, signals, shutdown ---------------------------------------------------------------
    def on_ready(self) -> list[Action]:
        """READY went to the frontends (it is the announcement: no STATUS)."""
        self.state = EngineState.RUNNING
        return []

    def on_signal(self) -> list[Action]:
        """SIGTERM/SIGINT, in the signal handler: counted now, handled by the loop."""
        self.num_signals += 1
        if self.state == EngineState.STARTING and self.num_signals >= 2:
            return [AbandonStart()]  # second signal while loading: give up the load
        return [Wake()]

    def on_wakeup(self, now: float) -> list[Action]:
        """The loop takes the signals not handled yet: the first drains for
        ``drain_timeout_s``, a later one aborts the work."""
        actions: list[Action] = []
        while self.num_handled_signals < self.num_signals:
            self.num_handled_signals += 1
            number = self.num_handled_signals
            actions.append(Signalled(number))
            actions += self.on_shutdown(self.drain_timeout_s if number == 1 else 0.0, f"signal #{number}", now)
            if self.state == EngineState.STOPPED:
                break
        return actions

    def on_shutdown(self, drain_timeout_s: float | None, cause: str, now: float) -> list[Action]:
        """Drain for ``drain_timeout_s`` (None: ``drain_timeout_s`` of the settings; 0, or an
        UNHEALTHY engine: abort now). A second drain only shortens the deadline."""
        if drain_timeout_s is None:
            drain_timeout_s = self.drain_timeout_s
        if drain_timeout_s <= 0 or self.state == EngineState.UNHEALTHY:
            self.state = EngineState.STOPPED
            return [Stop(aborted=True, cause=cause)]
        if self.state != EngineState.DRAINING:
            self.deadline = now + drain_timeout_s
            self.state = EngineState.DRAINING
            return [SetState(EngineState.DRAINING, f"draining for up to {drain_timeout_s} s")]
        self.deadline = min(self.deadline, now + drain_timeout_s)
        return []

    def on_refused(self, slot: int, reason: str) -> list[Action]:
        self.state = EngineState.STOPPED
        return [Refused(slot, reason)]

    # -- the loop -------------------------------------------------------------------------------
    def before_inputs(self, now: float, has_work: bool) -> list[Action]:
        """Before taking input: a drained engine is done; an idle one (paused, unhealthy,
        or no work) blocks until its deadline; a busy one only takes what has arrived."""
        if self.state == EngineState.DRAINING and not has_work:
            self.state = EngineState.STOPPED
            return [Stop(aborted=False)]
        if self.state in (EngineState.PAUSED, EngineState.UNHEALTHY) or not has_work:
            return [Wait(self.deadline)]
        return [Wait(now)]

    def on_tick(self, now: float, has_work: bool) -> list[Action]:
        """After taking input: an UNHEALTHY engine dies when its recovery window is over,
        a draining one stops when drained or out of time; else step when there is work."""
        if self.state == EngineState.UNHEALTHY:
            if self.deadline is not None and now >= self.deadline:
                self.state = EngineState.DEAD
                return [Die(f"no recovery within {self.recovery_timeout_s} s after: {self.fault_reason}")]
            return []
        stop = self.on_drain_tick(now, has_work)
        if stop:
            return stop
        return [Step()] if self.can_step and has_work else []

    def on_drain_tick(self, now: float, has_work: bool) -> list[Action]:
        """A draining engine stops when drained, or aborts its work at the deadline."""
        if self.state != EngineState.DRAINING:
            return []
        if not has_work:
            self.state = EngineState.STOPPED
            return [Stop(aborted=False)]
        if now >= self.deadline:
            self.state = EngineState.STOPPED
            return [Stop(aborted=True, cause="drain timeout")]
        return []

    def refusal_for_new_request(self) -> str | None:
        """Why a new request is refused now (None: take it). A re-forming rank takes it:
        it waits for the re-formed group."""
        if self.reforming:
            return None
        if self.state == EngineState.DRAINING:
            return _DRAIN_REFUSAL
        if self.state == EngineState.UNHEALTHY:
            return f"engine is unhealthy: {self.fault_reason}"
        return None

    # -- faults ---------------------------------------------------------------------------------
    def on_fault(self, reason: str, now: float) -> list[Action]:
        """An engine-level fault (not pinned to requests), caught at ``now``: die at once
        without a recovery window, else UNHEALTHY until ``now + recovery_timeout_s``."""
        if self.recovery_timeout_s <= 0:
            self.state = EngineState.DEAD
            return [Die(reason, fault_monotonic_s=now)]
        self.fault_reason = reason
        self.deadline = now + self.recovery_timeout_s
        self.state = EngineState.UNHEALTHY
        return [SetState(EngineState.UNHEALTHY, reason, drop_requests=not self.keep_requests_on_fault)]

    def pause(self) -> list[Action]:
        if self.state != EngineState.RUNNING:
            raise EngineStateError(f"cannot pause in state {self.state.value}")
        self.state = EngineState.PAUSED
        return [SetState(EngineState.PAUSED, "paused (requests kept)")]

    def resume(self) -> list[Action]:
        """PAUSED or UNHEALTHY -> RUNNING, requests kept (a failed step's batch rolled back)."""
        if self.state not in (EngineState.PAUSED, EngineState.UNHEALTHY):
            raise EngineStateError(f"cannot resume in state {self.state.value}")
        return self._recover(reset=False)

    def reset(self) -> list[Action]:
        """-> RUNNING with every request dropped and the prefix cache emptied."""
        if self.state in _CANNOT_RESET:
            raise EngineStateError(f"cannot reset in state {self.state.value}")
        return self._recover(reset=True)

    def _recover(self, reset: bool) -> list[Action]:
        actions: list[Action] = [RollBack()] if self.state == EngineState.UNHEALTHY else []
        self.deadline = None
        self.fault_reason = ""
        self.state = EngineState.RUNNING
        actions.append(SetState(EngineState.RUNNING, "reset" if reset else "resumed", drop_requests=reset))
        if reset:
            actions.append(ResetPrefixCache())
        return actions

    # -- expert parallelism: the rank's group ---------------------------------------------------
    def on_group_lost(self, reason: str, now: float) -> list[Action]:
        """A collective or a group switch failed. A rank that served waits (requests kept)
        for a re-formed group until ``reform_timeout_s``; a RUNNING one is UNHEALTHY
        meanwhile, not announced: it keeps taking requests (they queue until the group is
        back), so the frontends must keep routing to it. A starting rank just goes on."""
        if self.state == EngineState.STARTING:
            return []
        self.reforming = True
        self.fault_reason = reason
        if self.reform_deadline is None:
            self.reform_deadline = now + self.reform_timeout_s
        if self.state == EngineState.RUNNING:
            self.state = EngineState.UNHEALTHY
        return []

    def on_group_formed(self, epoch: int) -> list[Action]:
        """The rank serves in ``epoch``'s group: a re-forming rank is RUNNING again."""
        if not self.reforming:
            return []
        self.reforming = False
        self.reform_deadline = None
        self.fault_reason = ""
        if self.state == EngineState.DRAINING:  # still leaving: at the next epoch boundary
            return []
        self.state = EngineState.RUNNING
        return [SetState(EngineState.RUNNING, f"re-formed at epoch {epoch}")]

    def on_leave_tick(self, now: float) -> list[Action]:
        """Expert parallelism: a draining rank leaves at an epoch boundary (when the group
        agrees), not when it runs out of work; only its drain deadline ends it here."""
        if self.state != EngineState.DRAINING or self.deadline is None or now < self.deadline:
            return []
        self.state = EngineState.STOPPED
        return [Stop(aborted=True, cause="drain timeout before its group let it go")]

    def on_reform_tick(self, now: float) -> list[Action]:
        """Still outside a group: a re-forming rank dies once its re-form window is over."""
        if self.reform_deadline is None or now < self.reform_deadline:
            return []
        self.state = EngineState.DEAD
        return [Die(f"no new epoch within {self.reform_timeout_s} s after: {self.fault_reason}")]
