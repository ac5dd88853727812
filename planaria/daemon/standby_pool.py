"""Warm standby EP engine processes, kept by the supervisor (`planaria serve --standby N`).

A standby (elastic/standby.py) is an interpreter with torch, transformers and the engine's
modules imported and no model state, waiting for its assignment on stdin. In EP mode the
supervisor keeps ``size`` of them per node: an engine start (a scale-up, or a restart)
takes one, writing the engine's arguments, log file and environment to its stdin, instead
of starting a new interpreter; the process goes on as that engine. A replacement starts
``refill_delay_s`` later, not at once: its imports would compete for the CPU with the
engine that is joining. The first standby starts once an engine serves, for the same reason.

Standbys are children like the others: spawned by the supervisor's spawner (own session,
killed with the supervisor), watched by their pidfds, stopped by pid at shutdown, listed
in `planaria status`. Lifecycle of one: warming (spawned, importing) -> ready (its ready
file exists) -> taken (it is an engine now, out of the pool), or it exits (replaced after
the delay, doubled for each one that dies young in a row, up to ``max_delay_s``).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from planaria.daemon.children import Child, ChildSpec, open_child_log

YOUNG_S = 60.0  # a standby that exits sooner than this counts toward the refill backoff


def write_assignment(child: Child, line: bytes) -> None:
    """Hand a standby its assignment (OSError when it is gone)."""
    stdin = child.popen.stdin
    stdin.write(line)
    stdin.close()


@dataclass
class Standby:
    child: Child
    started_at: float
    ready_file: Path


class StandbyPool:
    def __init__(self, size: int, launcher, spawner, clock: Callable[[], float], log, *,
                 refill_delay_s: float = 10.0, max_delay_s: float = 300.0,
                 write: Callable[[Child, bytes], None] = write_assignment) -> None:
        self.size = size
        self.launcher, self.spawner, self.clock, self.log = launcher, spawner, clock, log
        self.refill_delay_s, self.max_delay_s = refill_delay_s, max_delay_s
        self.write = write
        self.standbys: list[Standby] = []
        self.due_at: float | None = None  # when to start the missing ones (None: not now)
        self.enabled = False
        self.num_taken = 0
        self._young_exits = 0
        self._numbers = itertools.count(1)

    # -- keeping it full ----------------------------------------------------------------------
    def enable(self, now: float) -> None:
        """Start filling (called once an engine serves)."""
        if not self.enabled:
            self.enabled = True
            self.due_at = now

    def tick(self, now: float) -> float | None:
        """Start the missing standbys when due; returns when to be called next (or None)."""
        if self.due_at is not None and self.due_at <= now:
            self.due_at = None
            while len(self.standbys) < self.size:
                self._start(now)
        return self.due_at

    def _start(self, now: float) -> None:
        number = next(self._numbers)
        ready_file = Path(self.launcher.config.runtime_dir) / f"standby-{number}.ready"
        ready_file.unlink(missing_ok=True)
        child = self.spawner.spawn(self.launcher.standby(number, str(ready_file)))
        self.standbys.append(Standby(child, now, ready_file))
        self.log.info("standby started", pid=child.pid, number=number)

    def _refill_later(self, now: float) -> None:
        delay = min(self.refill_delay_s * 2 ** self._young_exits, self.max_delay_s)
        self.due_at = min(self.due_at if self.due_at is not None else float("inf"), now + delay)

    # -- using one ----------------------------------------------------------------------------
    def take(self, spec: ChildSpec, now: float) -> Child | None:
        """A standby that goes on as the EP engine of ``spec`` (None: none to take, or
        ``spec`` is not an EP engine's)."""
        if spec.argv[1:3] != ["-m", "planaria.elastic.ep_proc"]:
            return None
        ready_first = sorted(self.standbys, key=lambda s: not s.ready_file.exists())
        for standby in ready_first:
            env = {k: v for k, v in spec.env.items() if standby.child.spec.env.get(k) != v}
            line = json.dumps({"argv": spec.argv[3:], "log_path": spec.log_path, "env": env}) + "\n"
            try:
                if spec.log_path:
                    open_child_log(spec, f" (warm standby pid {standby.child.pid})").close()
                self.write(standby.child, line.encode())
            except OSError as exc:  # it died meanwhile: its exit is reaped as usual
                self.log.warning("standby not usable", pid=standby.child.pid, error=str(exc))
                continue
            self.standbys.remove(standby)
            standby.ready_file.unlink(missing_ok=True)
            standby.child.spec = spec  # the process is that engine now
            self.num_taken += 1
            self._refill_later(now)
            return standby.child
        return None

    # -- events --------------------------------------------------------------------------------
    def on_exit(self, child: Child, now: float, reason: str) -> bool:
        """``child`` exited: True if it was one of ours (it is replaced later)."""
        standby = next((s for s in self.standbys if s.child is child), None)
        if standby is None:
            return False
        self.standbys.remove(standby)
        standby.ready_file.unlink(missing_ok=True)
        self._young_exits = self._young_exits + 1 if now - standby.started_at < YOUNG_S else 0
        if self.enabled:
            self._refill_later(now)
        self.log.warning("standby exited", pid=child.pid, reason=reason,
                         replaced_in_s=round(self.due_at - now, 3) if self.due_at is not None else None)
        return True

    # -- views, shutdown -----------------------------------------------------------------------
    def children(self) -> list[Child]:
        return [s.child for s in self.standbys]

    def stop(self, sig: int) -> None:
        """Signal every standby (shutdown); none is started again."""
        self.enabled, self.due_at = False, None
        for s in self.standbys:
            s.child.send_signal(sig)

    def status(self, now: float) -> dict[str, Any]:
        return {"size": self.size, "num_taken": self.num_taken,
                "next_start_in_s": round(self.due_at - now, 3) if self.due_at is not None else None,
                "processes": [{"pid": s.child.pid, "state": "ready" if s.ready_file.exists() else "warming",
                               "uptime_s": round(now - s.started_at, 3)} for s in self.standbys]}
