"""Hung-frontend detection: the frontend's event loop must answer, or it is killed.

The frontend's asyncio loop sends a beat every ``--heartbeat-interval-s`` from a task of
its own (frontend/liveness.py), so a beat is an answer of the loop that serves HTTP: a
frontend frozen in a CPU-bound handler, a blocking call or a deadlock sends none, while a
thread of it would have gone on beating. The run loop checks who sent a beat (the
kernel's pid of the sender, not the beat's claim: common/liveness.py) and the supervisor
passes the current frontend's beats to ``answered``, timestamped on its own monotonic
clock when received.

Judgement, per frontend process (one ``_Incarnation``, dropped whole on a new start):

- from its start to its first answer it gets ``start_timeout_s`` (the supervisor passes
  ``--handshake-timeout-s``, the time engines give a frontend to take them): imports, the
  tokenizer and binding the port come before its loop runs the beat task, and take
  seconds, so start-up is not judged by the hang timeout;
- after an answer, no further answer for ``hang_timeout_s`` means hung;
- ``hang_timeout_s`` 0 turns the judgement off (answers are still counted, for status).

Pure logic, clock injected: the supervisor calls ``start`` per spawn, ``answered`` per
beat, ``why_hung(now)`` on its loop (``deadline()`` says when next to look), and acts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class _Incarnation:
    pid: int
    started_at: float
    last_answer_at: float | None = None
    num_answers: int = 0
    lag_s: float = 0.0  # the frontend's own measure of its loop's latest stall
    routing: Any = None  # its router's figures, as of its last beat (common.liveness.RoutingSummary)


class FrontendWatch:
    """Tracks the current frontend's answers and says when it counts as hung."""

    def __init__(self, hang_timeout_s: float, start_timeout_s: float) -> None:
        self.hang_timeout_s = 0.0
        self.start_timeout_s = 0.0
        self.reconfigure(hang_timeout_s, start_timeout_s)
        self._current: _Incarnation | None = None

    def reconfigure(self, hang_timeout_s: float, start_timeout_s: float) -> None:
        """New limits (a reload); the frontend's answers so far still count."""
        if hang_timeout_s < 0:
            raise ValueError(f"hang_timeout_s must be >= 0 (0: off), got {hang_timeout_s}")
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s}")
        self.hang_timeout_s = float(hang_timeout_s)
        self.start_timeout_s = float(start_timeout_s)

    def start(self, pid: int, now: float) -> None:
        """A frontend process ``pid`` was started at ``now``: a fresh start grace."""
        self._current = _Incarnation(pid=pid, started_at=now)

    def forget(self) -> None:
        """The frontend exited or was killed: nothing to judge until the next ``start``."""
        self._current = None

    def answered(self, pid: int, now: float, lag_s: float = 0.0, routing: Any = None) -> bool:
        """A beat of ``pid``'s event loop, received at ``now``; False (ignored) when ``pid``
        is not the current frontend (an older one, or none started). ``routing``: the
        router's figures the beat carried (kept for ``routing()``)."""
        inc = self._current
        if inc is None or inc.pid != pid:
            return False
        if inc.last_answer_at is None or now >= inc.last_answer_at:
            inc.last_answer_at = now
        inc.num_answers += 1
        inc.lag_s = float(lag_s)
        if routing is not None:
            inc.routing = routing
        return True

    def routing(self) -> dict[str, Any] | None:
        """The current frontend's router as of its last beat (docs/routing.md), None before."""
        inc = self._current
        return None if inc is None or inc.routing is None else inc.routing.to_status()

    def deadline(self) -> float | None:
        """When the current frontend becomes hung if it does not answer (None: not judged)."""
        inc = self._current
        if inc is None or self.hang_timeout_s <= 0:
            return None
        if inc.last_answer_at is None:
            return inc.started_at + self.start_timeout_s
        return inc.last_answer_at + self.hang_timeout_s

    def why_hung(self, now: float) -> str | None:
        """Why the current frontend counts as hung at ``now`` (None: it does not)."""
        due = self.deadline()
        if due is None or now < due:
            return None
        inc = self._current
        if inc.last_answer_at is None:
            return (f"frontend hung: event loop never answered in {now - inc.started_at:.1f} s "
                    f"since its start (limit {self.start_timeout_s:g} s)")
        return (f"frontend hung: event loop did not answer for {now - inc.last_answer_at:.1f} s "
                f"(limit {self.hang_timeout_s:g} s)")

    def status(self, now: float) -> dict[str, Any]:
        """For `planaria status`: the age of the last answer (None: none yet), how many
        answers, the loop's latest stall, and the limit."""
        inc = self._current
        last = None if inc is None else inc.last_answer_at
        return {"last_answer_age_s": None if last is None else round(max(0.0, now - last), 3),
                "num_answers": 0 if inc is None else inc.num_answers,
                "loop_lag_s": None if inc is None or last is None else inc.lag_s,
                "hang_timeout_s": self.hang_timeout_s}
