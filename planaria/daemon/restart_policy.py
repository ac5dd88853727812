"""When to restart a child that exited: backoff, flap hold-off and a retry limit.

Decide, then act: the supervisor reports what happened (``record_start``,
``record_exit``, ``record_healthy``) and asks ``decide(child_id, now)`` for an
``Action``; it performs the action itself. The policy owns no timers, threads or
processes, and the clock is injected (every ``now`` is one monotonic clock).

Per child, in order of precedence, ``decide`` answers:

- ``GiveUp(reason)`` when its last exit code is one of ``fatal_exit_codes`` (an exit that
  says "restarting me as I am cannot help", e.g. an engine refused for a configuration
  mismatch), so that it is not restarted in a loop;
- ``GiveUp(reason)`` when the child has failed more than ``retry_limit`` times in a row
  without becoming healthy (``retry_limit=None`` never gives up; ``0`` never restarts);
- ``HoldOff(until, reason)`` while a flap hold is on: ``flap_max_exits`` exits inside
  ``flap_window_s`` start a hold of ``flap_hold_s`` seconds, after which the child is
  retried with a clean flap window;
- ``RestartAt(t)`` while the backoff since the last exit has not elapsed;
- ``RestartNow()`` otherwise (also for a child that never failed).

The backoff after the n-th consecutive failure is
``min(backoff_max_s, backoff_initial_s * backoff_factor ** (n - 1))``. ``record_healthy``
resets it (and the retry count) once the child has run for ``stable_s`` seconds.

Start-up failures and deaths after serving are told apart. ``record_served`` says the
current start did work (an engine completed a step). An exit after that is a death from
outside or from the work (OOM killer, an operator, a hung device, a bad request), not a
crash loop: it is restarted after ``served_delay_s``, counts toward neither the backoff
nor the flap hold (and ends a streak of start-up failures), and only a rate cap bounds
it: at most ``served_max_restarts`` such restarts inside ``flap_window_s``, the next one
waiting until the oldest leaves the window. An exit before serving (died before READY,
or failed its first step) is a start-up failure: backoff and flap hold as above.

The availability floor: ``decide(..., last_one=True)`` says no other child of the group
is starting or serving (nor due without a hold). Then a flap hold or a long backoff is cut
to ``backoff_max_s`` after the exit, and the action says ``floor=True``: a node (or an EP
group) always has an engine coming back, at the backoff cap at worst. ``GiveUp`` for a
fatal exit code or the retry limit stays (restarting as it is cannot help).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Hashable, Union

from planaria.daemon.flapping import FlapDetector


@dataclass(frozen=True, slots=True)
class RestartNow:
    """Start the child again now."""


@dataclass(frozen=True, slots=True)
class RestartAt:
    """Start the child again at time ``t`` (same clock as ``now``). ``floor``: only the
    availability floor brings it back this soon (a hold or a longer backoff was cut)."""

    t: float
    floor: bool = False


@dataclass(frozen=True, slots=True)
class HoldOff:
    """The child is flapping: do not start it before ``until``; ask again then."""

    until: float
    reason: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Stop restarting the child; report ``reason`` to the operator."""

    reason: str


Action = Union[RestartNow, RestartAt, HoldOff, GiveUp]


@dataclass(slots=True)
class _ChildState:
    flap: FlapDetector
    num_failures: int = 0  # consecutive exits since the child was last healthy
    num_starts: int = 0
    started_at: float | None = None
    last_exit_at: float | None = None
    last_exit_code: int | None = None
    last_exit_reason: str = ""
    hold_until: float | None = None
    hold_reason: str = ""
    served: bool = False  # the current start did work (record_served)
    last_exit_served: bool = False  # the last exit came after serving
    served_exits: deque[float] = field(default_factory=deque)  # times, inside flap_window_s
    exit_history: list[tuple[float, int | None, str]] = field(default_factory=list)


class RestartPolicy:
    """Restart decisions for any number of children, keyed by a hashable child id."""

    #: how many (time, exit code, reason) entries each child keeps for ``last_exits``
    HISTORY_LEN = 16

    def __init__(self, backoff_initial_s: float = 1.0, backoff_max_s: float = 60.0,
                 backoff_factor: float = 2.0, flap_window_s: float = 60.0,
                 flap_max_exits: int = 5, flap_hold_s: float = 300.0,
                 retry_limit: int | None = None, *, stable_s: float = 0.0,
                 fatal_exit_codes: Mapping[int, str] | None = None,
                 served_delay_s: float = 0.0, served_max_restarts: int = 30) -> None:
        if backoff_initial_s < 0:
            raise ValueError(f"backoff_initial_s must be >= 0, got {backoff_initial_s}")
        if backoff_max_s < backoff_initial_s:
            raise ValueError(f"backoff_max_s ({backoff_max_s}) must be >= "
                             f"backoff_initial_s ({backoff_initial_s})")
        if backoff_factor < 1:
            raise ValueError(f"backoff_factor must be >= 1, got {backoff_factor}")
        if flap_hold_s < 0:
            raise ValueError(f"flap_hold_s must be >= 0, got {flap_hold_s}")
        if retry_limit is not None and retry_limit < 0:
            raise ValueError(f"retry_limit must be >= 0 or None, got {retry_limit}")
        if stable_s < 0:
            raise ValueError(f"stable_s must be >= 0, got {stable_s}")
        if served_delay_s < 0:
            raise ValueError(f"served_delay_s must be >= 0, got {served_delay_s}")
        if served_max_restarts < 1:
            raise ValueError(f"served_max_restarts must be >= 1, got {served_max_restarts}")
        # Validates flap_window_s and flap_max_exits once, before any child exists.
        FlapDetector(flap_window_s, flap_max_exits)
        self.backoff_initial_s = float(backoff_initial_s)
        self.backoff_max_s = float(backoff_max_s)
        self.backoff_factor = float(backoff_factor)
        self.flap_window_s = float(flap_window_s)
        self.flap_max_exits = int(flap_max_exits)
        self.flap_hold_s = float(flap_hold_s)
        self.retry_limit = retry_limit
        self.stable_s = float(stable_s)
        self.served_delay_s = float(served_delay_s)
        self.served_max_restarts = int(served_max_restarts)
        #: exit code -> what it means; such an exit is not restarted (see ``decide``)
        self.fatal_exit_codes = dict(fatal_exit_codes or {})
        self._children: dict[Hashable, _ChildState] = {}

    def reconfigure(self, **params: object) -> None:
        """Change settings live (a reload), keeping every child's history and counts.
        Takes the constructor's keyword names; validates them all before changing any."""
        names = ("backoff_initial_s", "backoff_max_s", "backoff_factor", "flap_window_s",
                 "flap_max_exits", "flap_hold_s", "retry_limit", "stable_s", "served_delay_s",
                 "served_max_restarts")
        unknown = set(params) - set(names)
        if unknown:
            raise ValueError(f"unknown restart policy settings: {sorted(unknown)}")
        merged = {name: params.get(name, getattr(self, name)) for name in names}
        fresh = RestartPolicy(**merged)  # validates
        for name in names:
            setattr(self, name, getattr(fresh, name))
        for state in self._children.values():
            state.flap.window_s = self.flap_window_s
            state.flap.max_exits = self.flap_max_exits

    # -- facts reported by the supervisor ------------------------------------------------

    def record_start(self, child_id: Hashable, now: float) -> None:
        """The child was (re)started at ``now``; every start after the first is a restart."""
        state = self._state(child_id)
        state.num_starts += 1
        state.started_at = now
        state.served = False

    def record_served(self, child_id: Hashable, now: float) -> None:
        """The current start did work (an engine completed a step): an exit from now on is
        a death after serving, not a start-up failure."""
        state = self._children.get(child_id)
        if state is not None and state.started_at is not None:
            state.served = True

    def record_exit(self, child_id: Hashable, now: float, exit_code: int | None = None,
                    reason: str = "") -> None:
        """The child exited at ``now`` (``exit_code`` None when unknown, e.g. killed)."""
        state = self._state(child_id)
        served, state.served = state.served, False
        state.started_at = None
        state.last_exit_at = now
        state.last_exit_code = exit_code
        state.last_exit_reason = reason
        state.last_exit_served = served
        state.exit_history.append((now, exit_code, reason))
        del state.exit_history[:-self.HISTORY_LEN]
        if served:  # killed from outside or by its work: not a crash loop
            state.num_failures = 1  # this exit only: the start-up streak is over
            state.hold_until, state.hold_reason = None, ""
            state.served_exits.append(now)
            while state.served_exits and state.served_exits[0] <= now - self.flap_window_s:
                state.served_exits.popleft()
            return
        state.num_failures += 1
        if state.flap.record_exit(now):
            state.hold_until = now + self.flap_hold_s
            state.hold_reason = (f"flapping: {state.flap.max_exits} exits within "
                                 f"{self.flap_window_s:g}s; holding off {self.flap_hold_s:g}s")
            state.flap.clear()

    def record_healthy(self, child_id: Hashable, now: float) -> bool:
        """The child looks healthy at ``now``. Once it has run ``stable_s`` seconds since
        its last start, its backoff and retry count are reset; returns True if so."""
        state = self._children.get(child_id)
        if state is None or state.started_at is None:
            return False
        if now - state.started_at < self.stable_s:
            return False
        state.num_failures = 0
        state.hold_until = None
        state.hold_reason = ""
        return True

    def forget(self, child_id: Hashable) -> None:
        """Drop everything known about a child that was removed for good."""
        self._children.pop(child_id, None)

    # -- the decision ---------------------------------------------------------------------

    def decide(self, child_id: Hashable, now: float, last_one: bool = False) -> Action:
        """What to do about ``child_id`` at ``now``; has no side effects. ``last_one``: no
        other child of its group is starting, serving or due without a hold (the
        availability floor applies)."""
        action = self._decide(child_id, now)
        if not last_one or isinstance(action, (RestartNow, GiveUp)):
            return action
        state = self._children[child_id]
        cap = state.last_exit_at + self.backoff_max_s
        due = action.until if isinstance(action, HoldOff) else action.t
        if due <= cap:
            return action
        return RestartNow() if now >= cap else RestartAt(cap, floor=True)

    def _decide(self, child_id: Hashable, now: float) -> Action:
        state = self._children.get(child_id)
        if state is None or state.num_failures == 0 or state.last_exit_at is None:
            return RestartNow()
        meaning = self.fatal_exit_codes.get(state.last_exit_code)
        if meaning is not None:
            return GiveUp(f"{meaning} (exit code {state.last_exit_code}); not restarted: "
                          f"fix the configuration, then `planaria restart`")
        if self.retry_limit is not None and state.num_failures > self.retry_limit:
            return GiveUp(f"{child_id} failed {state.num_failures} times in a row without "
                          f"becoming healthy (retry limit {self.retry_limit}); "
                          f"last exit: {self._describe_exit(state)}")
        if state.last_exit_served:
            due = state.last_exit_at + self.served_delay_s
            exits = state.served_exits
            if len(exits) > self.served_max_restarts:  # the rate cap
                due = max(due, exits[-self.served_max_restarts - 1] + self.flap_window_s)
            return RestartNow() if now >= due else RestartAt(due)
        if state.hold_until is not None and now < state.hold_until:
            return HoldOff(state.hold_until, state.hold_reason)
        due = state.last_exit_at + self.backoff_s(state.num_failures)
        if state.hold_until is not None:
            due = max(due, state.hold_until)
        return RestartNow() if now >= due else RestartAt(due)

    def backoff_s(self, num_failures: int) -> float:
        """Delay before restarting after ``num_failures`` consecutive failures."""
        if num_failures <= 0 or self.backoff_initial_s == 0:
            return 0.0
        delay = self.backoff_initial_s
        for _ in range(num_failures - 1):
            delay *= self.backoff_factor
            if delay >= self.backoff_max_s or self.backoff_factor == 1:
                break
        return min(delay, self.backoff_max_s)

    # -- read-only views ------------------------------------------------------------------

    def restarts(self, child_id: Hashable) -> int:
        """How many times the child was restarted (starts after the first), never reset."""
        state = self._children.get(child_id)
        return max(0, state.num_starts - 1) if state else 0

    def num_failures(self, child_id: Hashable) -> int:
        """Consecutive exits since the child was last healthy."""
        state = self._children.get(child_id)
        return state.num_failures if state else 0

    def last_exits(self, child_id: Hashable) -> list[tuple[float, int | None, str]]:
        """The most recent (time, exit code, reason) exits, oldest first."""
        state = self._children.get(child_id)
        return list(state.exit_history) if state else []

    def _state(self, child_id: Hashable) -> _ChildState:
        state = self._children.get(child_id)
        if state is None:
            state = _ChildState(flap=FlapDetector(self.flap_window_s, self.flap_max_exits))
            self._children[child_id] = state
        return state

    @staticmethod
    def _describe_exit(state: _ChildState) -> str:
        code = "unknown code" if state.last_exit_code is None else f"code {state.last_exit_code}"
        return f"{code}, {state.last_exit_reason}" if state.last_exit_reason else code
