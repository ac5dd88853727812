"""Flap detection: a sliding window of a child's exit times.

A child flaps when it exits ``max_exits`` times inside ``window_s`` seconds. The detector
only counts; what to do about flapping (hold off, then retry) is the restart policy's
decision (daemon/restart_policy.py). Times are whatever clock the caller injects, as long
as it is one monotonic clock throughout.
"""

from __future__ import annotations

from collections import deque


class FlapDetector:
    """Exit times of one child inside a sliding window of ``window_s`` seconds."""

    def __init__(self, window_s: float, max_exits: int) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if max_exits < 1:
            raise ValueError(f"max_exits must be >= 1, got {max_exits}")
        self.window_s = float(window_s)
        self.max_exits = int(max_exits)
        self._exit_times: deque[float] = deque()

    def record_exit(self, now: float) -> bool:
        """Count an exit at ``now``; True when the window now holds ``max_exits`` or more."""
        self._exit_times.append(now)
        self._prune(now)
        return len(self._exit_times) >= self.max_exits

    def num_exits(self, now: float) -> int:
        """Exits in the window ending at ``now`` (the window is (now - window_s, now])."""
        return sum(1 for t in self._exit_times if now - self.window_s < t <= now)

    def is_flapping(self, now: float) -> bool:
        return self.num_exits(now) >= self.max_exits

    def clear(self) -> None:
        """Forget every exit (after a hold-off, the child starts with a clean window)."""
        self._exit_times.clear()

    def _prune(self, now: float) -> None:
        while self._exit_times and self._exit_times[0] <= now - self.window_s:
            self._exit_times.popleft()
