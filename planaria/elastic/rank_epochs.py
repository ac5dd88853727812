"""One rank's epoch bookkeeping as one state machine: which epoch it serves, which one it
is moving to, which ones it must never take again. Pure logic: no etcd, no torch, no
clock; the EP engine process (elastic/ep_proc.py) feeds it and carries out its actions.

Phases (``RankPhase``) and transitions, ``e < f < g`` epoch numbers::

    OUTSIDE       --take, newest e names us-------------------> PREPARING(e)   [Arrive(e)]
    OUTSIDE       --take, newest e does not name us-----------> OUTSIDE        (e seen)
    OUTSIDE       --take while leaving (whatever the epoch)---> LEFT           [Leave]
    PREPARING(e)  --take, newer f names us--------------------> PREPARING(f)   [Arrive(f)]
    PREPARING(e)  --take, newer f does not name us------------> OUTSIDE        (f seen)
    PREPARING(e)  --all_arrived-------------------------------> FORMING(e)     [Form(e)]
    SERVING(e)    --take, newer f-----------------------------> SERVING(e), pending f
    SERVING(e)    --switch agreed, pending f names us---------> FORMING(f)     [Form(f)]
    SERVING(e)    --switch agreed, pending f does not---------> LEFT           [Leave]
    SERVING(e)    --exit agreed (every rank leaving, idle)----> LEFT           [Leave]
    FORMING(f)    --formed------------------------------------> SERVING(f)
    any but LEFT  --failed(n)---------------------------------> OUTSIDE        (n seen)

Rules that the transitions keep:

- An epoch is taken at most once: every epoch up to ``seen`` is refused, failed, or was
  passed over; a failed epoch is never formed again (the leader writes a newer one).
- A failure forgets only what failed. A pending (or prepared) epoch newer than the failed
  one is *not* seen: the next ``take`` takes the newest epoch again, so a rank whose old
  group broke while the leader's next epoch was already written joins that epoch at once
  (it does not wait for an abort).
- A rank in a group leaves only at an epoch boundary: a switch every rank agreed on that
  does not name it, or an exit every rank agreed on (all leaving, no work anywhere). A
  leaving rank outside any group leaves at once, even when the newest epoch names it:
  it has not arrived there, so nobody waits on it in a collective (the leader re-forms
  without it). One that already arrived (PREPARING) forms first: the others may be
  building that group with it.
- ``offer`` (the etcd watch thread) only records the newest epoch seen; every decision is
  made on the loop thread in ``take``.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Callable, Union

from planaria.elastic.keys import Epoch


class RankPhase(str, enum.Enum):
    """Where a rank stands (transitions: module docstring)."""

    OUTSIDE = "outside"
    PREPARING = "preparing"
    FORMING = "forming"
    SERVING = "serving"
    LEFT = "left"


@dataclass(frozen=True, slots=True)
class Arrive:
    """Prepare ``epoch``: set this rank's arrival key, then wait for every rank's."""

    epoch: Epoch


@dataclass(frozen=True, slots=True)
class Form:
    """Commit ``epoch``: build its group (from a group: leave it and re-home experts first)."""

    epoch: Epoch


@dataclass(frozen=True, slots=True)
class Leave:
    """Leave the cluster (hand the requests to survivors, exit 0)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Refuse:
    """``epoch`` fails a check this rank can make (it is never taken); log ``problem``."""

    epoch: Epoch
    problem: str


RankAction = Union[Arrive, Form, Leave, Refuse]


class RankEpochs:
    """The state machine of one rank (``engine_id``). ``problem(epoch)``: why this rank
    must not act on an epoch (None: it may), checked when the epoch is taken."""

    def __init__(self, engine_id: str, problem: Callable[[Epoch], str | None] = lambda _e: None) -> None:
        self.engine_id = engine_id
        self._problem = problem
        self._lock = threading.Lock()
        self._latest: Epoch | None = None  # the newest epoch offered (watch thread)
        self.phase = RankPhase.OUTSIDE
        self.current: Epoch | None = None  # SERVING: the group's epoch
        self.target: Epoch | None = None  # PREPARING / FORMING: the epoch being formed
        self.pending: Epoch | None = None  # SERVING: a newer epoch to switch to at a sync
        self.seen = -1  # no epoch up to this number is taken
        self.served = 0  # the last epoch served (0: never)
        self.failed = 0  # the last epoch whose group failed to form or run
        self.leaving = False

    # -- inputs --------------------------------------------------------------------------------
    def offer(self, epoch: Epoch) -> bool:
        """The watch saw ``epoch``; True when it is newer than every epoch offered before."""
        with self._lock:
            if self._latest is not None and epoch.number <= self._latest.number:
                return False
            self._latest = epoch
            return True

    @property
    def latest(self) -> Epoch | None:
        with self._lock:
            return self._latest

    def names_us(self, epoch: Epoch) -> bool:
        return self.engine_id in epoch.ranks

    def skip_stale(self) -> None:
        """Before the first join: an epoch already offered that names us belongs to a previous
        incarnation of this engine (its arrival keys are still in the store): never join it."""
        latest = self.latest
        if latest is not None and self.names_us(latest):
            self.seen = max(self.seen, latest.number)

    def request_leave(self) -> None:
        """Asked to go (drain, scale-down): leave at the next epoch boundary."""
        self.leaving = True

    def take(self) -> RankAction | None:
        """What to do about the newest epoch (None: nothing now)."""
        if self.phase in (RankPhase.LEFT, RankPhase.FORMING):
            return None
        if self.phase is RankPhase.OUTSIDE and self.leaving:  # nobody waits on it: go now
            self.phase = RankPhase.LEFT
            return Leave("left outside any group")
        latest = self.latest
        floor = max(self.seen, self._number(self.current), self._number(self.target), self._number(self.pending))
        if latest is not None and latest.number > floor:
            problem = self._problem(latest)
            if problem:
                self.seen = latest.number
                return Refuse(latest, problem)
            if self.phase is RankPhase.SERVING:
                self.pending = latest
                return None
            if self.names_us(latest):
                self.phase, self.target = RankPhase.PREPARING, latest
                return Arrive(latest)
            self.seen = latest.number  # outside a group, not named: remembered, not joined
            self.phase, self.target = RankPhase.OUTSIDE, None
        return None

    def all_arrived(self) -> Form:
        """PREPARING: every rank of the target epoch has arrived."""
        self._expect(RankPhase.PREPARING)
        self.phase = RankPhase.FORMING
        return Form(self.target)

    def switch_agreed(self) -> Form | Leave:
        """SERVING with a pending epoch: every rank agreed to move to it at this step."""
        self._expect(RankPhase.SERVING)
        if self.pending is None:
            raise ValueError("switch agreed with no pending epoch")
        new, self.pending = self.pending, None
        if not self.names_us(new):
            self.phase, self.seen = RankPhase.LEFT, max(self.seen, new.number)
            return Leave(f"scaled down: not a rank of epoch {new.number}")
        self.phase, self.target = RankPhase.FORMING, new
        return Form(new)

    def exit_agreed(self) -> Leave:
        """SERVING: every rank of the group is leaving and none has work."""
        self._expect(RankPhase.SERVING)
        self.phase = RankPhase.LEFT
        return Leave("every rank of the group left together")

    def formed(self) -> Epoch:
        """FORMING: the target's group is built; this rank serves it now."""
        self._expect(RankPhase.FORMING)
        self.phase, self.current, self.target = RankPhase.SERVING, self.target, None
        self.served = self.current.number
        return self.current

    def failed_at(self, number: int) -> None:
        """The group of epoch ``number`` (the one served, or the one being formed) failed.
        Only that epoch is never taken again; a newer pending one is taken afresh."""
        if self.phase is RankPhase.LEFT:
            return
        self.seen = max(self.seen, number)
        self.failed = max(self.failed, number)
        self.phase, self.current, self.target, self.pending = RankPhase.OUTSIDE, None, None, None

    # -- views ---------------------------------------------------------------------------------
    @property
    def in_group(self) -> bool:
        return self.phase is RankPhase.SERVING

    @property
    def pending_number(self) -> int | None:
        return self.pending.number if self.pending is not None else None

    @staticmethod
    def _number(epoch: Epoch | None) -> int:
        return epoch.number if epoch is not None else -1

    def _expect(self, phase: RankPhase) -> None:
        if self.phase is not phase:
            raise ValueError(f"rank {self.engine_id}: expected {phase.value}, is {self.phase.value}")
