"""Hung-engine detection from heartbeats: no step progress while work is queued, or no
heartbeat at all.

Each engine's heartbeat carries its step counter (bumped on every busy-loop step that
did work), whether it has work queued, and a timestamp on the supervisor's monotonic
clock (the time the heartbeat was received is the safest choice). An engine is hung
when its latest heartbeat says it has work and its step counter has not moved for
``hang_timeout_s`` — measured from the later of the last step change and the moment
work arrived after an idle spell. An engine that stops sending heartbeats while it had
work (frozen, SIGSTOPped, stuck in a collective) is caught the same way, because the
last known state is "has work, no progress".

Heartbeats come from a thread of their own, independent of the busy loop, so an engine
that sends none for ``silence_timeout_s`` (default twice ``hang_timeout_s``) is frozen
as a whole (SIGSTOPped, or wedged holding the GIL) even if its last heartbeat said it
was idle: work routed to it later would never be stepped nor reported. A process that
exited is the process sentinel's business, not this detector's (the supervisor forgets
an engine when it exits).

Pure logic, clock injected: the supervisor calls ``observe`` per heartbeat and
``check(now)`` on its loop, then decides what to do with the engines it gets back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable


@dataclass(frozen=True, slots=True)
class Heartbeat:
    step_counter: int
    has_work: bool
    timestamp: float


@dataclass(slots=True)
class _EngineProgress:
    last: Heartbeat
    progress_at: float  # when the step counter last moved, or work arrived after idle


class HangDetector:
    """Tracks step progress per engine id and reports the ones that are hung."""

    def __init__(self, hang_timeout_s: float, silence_timeout_s: float | None = None) -> None:
        if hang_timeout_s <= 0:
            raise ValueError(f"hang_timeout_s must be > 0, got {hang_timeout_s}")
        if silence_timeout_s is not None and silence_timeout_s < hang_timeout_s:
            raise ValueError(f"silence_timeout_s ({silence_timeout_s}) must be >= "
                             f"hang_timeout_s ({hang_timeout_s})")
        self.hang_timeout_s = float(hang_timeout_s)
        self._silence_timeout_s = None if silence_timeout_s is None else float(silence_timeout_s)
        self._engines: dict[Hashable, _EngineProgress] = {}

    @property
    def silence_timeout_s(self) -> float:
        """No heartbeat at all for this long: frozen (follows ``hang_timeout_s`` unless set)."""
        return self._silence_timeout_s or 2 * self.hang_timeout_s

    def observe(self, engine_id: Hashable, step_counter: int, has_work: bool,
                timestamp: float) -> None:
        """Take one heartbeat. Heartbeats older than the latest one seen are ignored."""
        beat = Heartbeat(int(step_counter), bool(has_work), float(timestamp))
        known = self._engines.get(engine_id)
        if known is None:
            self._engines[engine_id] = _EngineProgress(last=beat, progress_at=beat.timestamp)
            return
        if beat.timestamp < known.last.timestamp:
            return
        # Any change counts as progress, a lower counter too (the engine was restarted).
        stepped = beat.step_counter != known.last.step_counter
        work_arrived = beat.has_work and not known.last.has_work
        if stepped or work_arrived:
            known.progress_at = beat.timestamp
        known.last = beat

    def check(self, now: float) -> list[Hashable]:
        """Engines with work queued and no step progress for ``hang_timeout_s``, or with
        no heartbeat for ``silence_timeout_s``."""
        return [engine_id for engine_id in self._engines if self.why_hung(engine_id, now)]

    def why_hung(self, engine_id: Hashable, now: float) -> str | None:
        """Why ``engine_id`` counts as hung at ``now`` (None: it does not)."""
        p = self._engines.get(engine_id)
        if p is None:
            return None
        if p.last.has_work and now - p.progress_at >= self.hang_timeout_s:
            return (f"hung: work queued and no step progress for "
                    f"{now - p.progress_at:.1f}s (limit {self.hang_timeout_s:g}s)")
        if now - p.last.timestamp >= self.silence_timeout_s:
            return (f"frozen: no heartbeat for {now - p.last.timestamp:.1f}s "
                    f"(limit {self.silence_timeout_s:g}s)")
        return None

    def stalled_s(self, engine_id: Hashable, now: float) -> float:
        """Seconds without progress while busy (0.0 for idle or unknown engines)."""
        p = self._engines.get(engine_id)
        if p is None or not p.last.has_work:
            return 0.0
        return max(0.0, now - p.progress_at)

    def last_heartbeat(self, engine_id: Hashable) -> Heartbeat | None:
        p = self._engines.get(engine_id)
        return p.last if p else None

    def forget(self, engine_id: Hashable) -> None:
        """Drop an engine (it exited or was killed); a restarted one starts fresh."""
        self._engines.pop(engine_id, None)


class StoppedWatch:
    """Processes found stopped by job control (SIGSTOP/SIGTSTP: state T, not a tracer's
    stop) for ``timeout_s``: they cannot step, and whoever stopped them is not going to
    wake them in time, so they are killed without waiting for the hang timeout. Keyed by
    pid, so a restarted process starts fresh. Pure: the caller probes the process state."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self._since: dict[int, float] = {}

    def observe(self, pid: int, stopped: bool, now: float) -> float | None:
        """Seconds it has been stopped, once that reaches ``timeout_s`` (else None)."""
        if not stopped:
            self._since.pop(pid, None)
            return None
        since = self._since.setdefault(pid, now)
        return now - since if now - since >= self.timeout_s else None

    def forget(self, pid: int) -> None:
        self._since.pop(pid, None)
