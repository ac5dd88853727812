"""The leader's planner: from the current epoch, the desired size and the live engines,
decide what the next epoch is. Pure logic: no etcd, no clock (``now`` is passed in).

``plan_epoch`` returns one action; the leader's executor performs it (write the epoch
with the fenced CAS, drive the op record, tell engines to switch).

Rules, in order:

1. A rank of the current epoch that is not live (dead, or DRAINING: it leaves at the next
   epoch boundary) is left out: **Reform** to the others (ranks keep their order,
   renumbered from 0), whatever ``desired`` says. Scaling back up to ``desired`` is a
   later, separate decision, once a replacement is live.
2. No epoch yet (or an empty one): **ScaleUp** with the first ``desired`` live engines,
   or as many as are live (serving starts with what is there; the rest join later).
3. ``desired`` above the world size: **ScaleUp** appending new live engines as the new
   highest ranks, but only once *all* the joining engines are live (one group switch,
   not one per arrival).
4. ``desired`` below the world size: **ScaleDown**, the highest ranks depart.
5. Otherwise **NoChange** (with the reason, for status and logs).

Existing ranks never move in 3 and 4, so the only experts that change hands are those
re-homed by the new expert map (see :func:`moves`).

With ``allowed`` (the engines the leader's placement keeps, elastic/placement.py), 2-4
become: the ranks that stay are the current ranks in ``allowed`` (at most ``desired``);
the rest depart; new ranks come from the live engines in ``allowed``. A switch that adds
ranks waits until all of them are live (the departing ranks serve meanwhile); one that
both adds and removes (an engine moved to another node) is a **Rebalance**, one switch.

``plan_abort`` judges a switch in progress: the current epoch is not served by all its
ranks yet, and some rank reported that it failed to form or run it (``failed_epoch``), or
it has been ``switch_timeout_s`` since the leader wrote it. Then the switch is aborted:
**Abort** to the largest healthy set — the ranks of the epoch that are live and either
served before (the old membership, still serving or waiting) or reported the failure
(alive and answering). A rank that never served and said nothing (a joiner that never
arrived, or hung) is left out.
"""

from __future__ import annotations

import msgspec

from planaria.elastic.keys import EngineRecord, EngineRecordState, Epoch


class NoChange(msgspec.Struct, frozen=True):
    reason: str


class ScaleUp(msgspec.Struct, frozen=True):
    epoch: Epoch
    joining: list[str]


class ScaleDown(msgspec.Struct, frozen=True):
    epoch: Epoch
    departing: list[str]


class Reform(msgspec.Struct, frozen=True):
    epoch: Epoch
    dead: list[str]


class Rebalance(msgspec.Struct, frozen=True):
    epoch: Epoch
    joining: list[str]
    departing: list[str]


class Abort(msgspec.Struct, frozen=True):
    epoch: Epoch
    failed: int            # the number of the epoch whose switch is aborted
    excluded: list[str]    # its ranks left out (never served and silent, or gone)
    reason: str


PlanAction = NoChange | ScaleUp | ScaleDown | Rebalance | Reform | Abort
LIVE_STATES = frozenset({EngineRecordState.READY, EngineRecordState.SERVING, EngineRecordState.PAUSED,
                         EngineRecordState.UNHEALTHY})


class ExpertMove(msgspec.Struct, frozen=True):
    expert: int
    src_rank: int
    dst_rank: int


def expert_map(num_experts: int, world_size: int) -> list[int]:
    """Expert -> rank, contiguous and balanced: the first ``num_experts % world_size``
    ranks hold one extra expert. ``expert_map(10, 3) == [0,0,0,0,1,1,1,2,2,2]``."""
    if num_experts < 0:
        raise ValueError(f"num_experts must be >= 0, got {num_experts}")
    if world_size <= 0:
        if num_experts == 0:
            return []
        raise ValueError(f"world_size must be >= 1 to hold experts, got {world_size}")
    base, extra = divmod(num_experts, world_size)
    out: list[int] = []
    for rank in range(world_size):
        out.extend([rank] * (base + (1 if rank < extra else 0)))
    return out


def moves(old_map: list[int], new_map: list[int]) -> list[ExpertMove]:
    """The experts whose rank changes between two maps of the same model."""
    if len(old_map) != len(new_map):
        raise ValueError(f"maps cover {len(old_map)} and {len(new_map)} experts")
    return [ExpertMove(expert, src, dst)
            for expert, (src, dst) in enumerate(zip(old_map, new_map)) if src != dst]


def engine_moves(old: Epoch, new: Epoch) -> list[tuple[int, str | None, str]]:
    """``(expert, src_engine, dst_engine)`` for every expert whose engine changes.

    ``src_engine`` is None when the old holder is not in the new epoch (dead or
    departed before handing over): the new holder loads the expert from the weights.
    """
    if len(old.expert_map) != len(new.expert_map):
        raise ValueError("epochs map different numbers of experts")
    survivors = set(new.ranks)
    out = []
    for expert, (src_rank, dst_rank) in enumerate(zip(old.expert_map, new.expert_map)):
        src, dst = old.ranks[src_rank], new.ranks[dst_rank]
        if src != dst:
            out.append((expert, src if src in survivors else None, dst))
    return out


def epoch_served(epoch: Epoch, records: dict[str, EngineRecord]) -> bool:
    """Every rank of ``epoch`` reports it serves that epoch."""
    return all(e in records and records[e].epoch == epoch.number and records[e].state == EngineRecordState.SERVING
               for e in epoch.ranks)


def plan_abort(current: Epoch | None, records: dict[str, EngineRecord], num_experts: int, now: float,
               switch_timeout_s: float, *, rendezvous: str = "", leader: str = "") -> Abort | None:
    """An Abort of the current epoch's switch when it failed or timed out, else None."""
    if current is None or not current.ranks or epoch_served(current, records):
        return None
    n = current.number
    reports = {e: records[e].error for e in current.ranks if e in records and records[e].failed_epoch >= n}
    timed_out = now - current.created_at > switch_timeout_s
    if not reports and not timed_out:
        return None
    healthy = [e for e in current.ranks if e in records and records[e].state in LIVE_STATES
               and (e in reports or records[e].served_epoch > 0)]
    if not healthy:
        return None  # nobody to re-form with: wait for engines (or a Reform when they die)
    if reports:
        first = sorted(reports)[0]
        reason = f"epoch {n}: {len(reports)} rank(s) failed to switch; {first}: {reports[first] or 'no detail'}"
    else:
        reason = f"epoch {n}: not served by all its ranks within {switch_timeout_s:g} s"
    excluded = [e for e in current.ranks if e not in healthy]
    if excluded:
        reason += f"; left out: {', '.join(excluded)}"
    epoch = Epoch(number=n + 1, world_size=len(healthy), ranks=healthy,
                  expert_map=expert_map(num_experts, len(healthy)), rendezvous=rendezvous, leader=leader,
                  created_at=now)
    return Abort(epoch, n, excluded, reason)


def plan_epoch(current: Epoch | None, desired: int, live_engines: list[str], num_experts: int,
               now: float, *, rendezvous: str = "", leader: str = "",
               allowed: set[str] | None = None) -> PlanAction:
    """Decide the next epoch. ``live_engines``: engines ready to be ranks, in preference
    order (the caller sorts them). ``rendezvous`` and ``leader`` go into a new epoch.
    ``allowed``: the engines the placement keeps (None: any live engine may be a rank)."""
    if desired < 0:
        raise ValueError(f"desired must be >= 0, got {desired}")
    live = list(dict.fromkeys(live_engines))
    live_set = set(live)

    def make(ranks: list[str]) -> Epoch:
        return Epoch(number=(current.number + 1) if current is not None else 1,
                     world_size=len(ranks), ranks=ranks,
                     expert_map=expert_map(num_experts, len(ranks)) if ranks else [],
                     rendezvous=rendezvous, leader=leader, created_at=now)

    ranks = list(current.ranks) if current is not None else []
    dead = [e for e in ranks if e not in live_set]
    if dead:
        return Reform(make([e for e in ranks if e in live_set]), dead)

    if allowed is not None:
        return _plan_placed(ranks, desired, [e for e in live if e in allowed], allowed, make)

    if not ranks:
        if desired == 0:
            return NoChange("desired is 0 and no epoch is formed")
        if not live:
            return NoChange(f"waiting for engines: 0/{desired} live")
        joining = live[:desired]
        return ScaleUp(make(joining), joining)

    if desired > len(ranks):
        candidates = [e for e in live if e not in set(ranks)]
        wanted = desired - len(ranks)
        if len(candidates) < wanted:
            return NoChange(f"waiting for joining engines: {len(candidates)}/{wanted} live")
        joining = candidates[:wanted]
        return ScaleUp(make(ranks + joining), joining)

    if desired < len(ranks):
        return ScaleDown(make(ranks[:desired]), ranks[desired:])

    return NoChange(f"world size {len(ranks)} is the desired size")


def _plan_placed(ranks: list[str], desired: int, live: list[str], allowed: set[str], make) -> PlanAction:
    """Rules 2-4 under a placement (``live``: the live engines it allows)."""
    if not ranks and desired == 0:
        return NoChange("desired is 0 and no epoch is formed")
    if not ranks:
        if not live:
            return NoChange(f"waiting for engines: 0/{desired} live")
        joining = live[:desired]
        return ScaleUp(make(joining), joining)
    keep = [e for e in ranks if e in allowed][:desired]
    departing = [e for e in ranks if e not in keep]
    wanted = desired - len(keep)
    candidates = [e for e in live if e not in set(ranks)]
    if len(candidates) < wanted:
        return NoChange(f"waiting for joining engines: {len(candidates)}/{wanted} live")
    joining = candidates[:wanted]
    if joining and departing:
        return Rebalance(make(keep + joining), joining, departing)
    if joining:
        return ScaleUp(make(keep + joining), joining)
    if departing:
        return ScaleDown(make(keep), departing)
    return NoChange(f"world size {len(ranks)} is the desired size and placed")
