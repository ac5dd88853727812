"""The leader's decision for one tick, from one frozen reading of the cluster. Pure logic:
no etcd, no clock (``ClusterView.now`` is the tick's time), no logging.

``EPController.tick`` (elastic/controller.py) observes the cluster into a ``ClusterView``
(the read order is documented there), calls ``decide(view, memory, settings)`` and carries
out the ``Decision``'s actions in order, stopping at the first write that fails. Nothing
here reads etcd between decisions: a decision is only as stale as the view, and every
epoch or placement write is a compare-and-swap against the revision the view read, so a
stale decision fails its write instead of landing.

What a tick decides, in order (the first that applies ends the tick's decisions, except
the refusals and KV publications, which only add to them):

1. An epoch that fails its checks: refused, nothing else (the cluster stays as it is).
2. An op or ``desired`` that fails its checks: refused and not acted on (a bad desired
   counts as the current world size). A rendezvous that is no known node's: logged only
   (after a failover the old leader's node is gone while its group serves on).
3. With placement (``planaria serve``): place the target over the nodes; write the
   placement when it changes (the op: LAUNCHING "placed ..."). The epoch is planned over
   the engines the placement keeps.
4. Profiled engines' KV figures not yet published: publish them (kv_budget).
5. Engines missing for the target (launching mode only, and no rank of the epoch is dead):
   launch them, with the group's smallest KV figure (op: LAUNCHING).
6. No epoch yet and too few engines live, within the first-epoch grace: wait.
7. The planner's next epoch (elastic/planner.py ``plan_epoch``). A Reform (a rank is dead
   or leaving) is written at once. Otherwise, a switch in progress that failed or timed
   out is aborted first (``plan_abort``: next epoch at the healthy set, op FAILED,
   desired rolled back, one transaction); a ScaleUp/ScaleDown/Rebalance waits while the
   current epoch is not served by all its ranks (one switch at a time).
8. NoChange: the active op is DONE once the epoch is served at the target size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Union

from planaria.elastic.keys import MAX_ENGINES, Desired, EngineRecord, EngineRecordState, Epoch, KVBudget, \
    NodeInfo, OpPhase, OpRecord, desired_problem
from planaria.elastic.placement import Placement, allowed_engines, capacity, default_target, max_engines, place
from planaria.elastic.planner import (LIVE_STATES, Abort, NoChange, Rebalance, Reform, ScaleDown, ScaleUp,
                                      epoch_served, plan_abort, plan_epoch)


@dataclass(frozen=True)
class ClusterView:
    """One tick's reading of the cluster (``*_refused``: why a record was not taken)."""

    now: float
    epoch: Epoch | None
    epoch_rev: int
    nodes: tuple[NodeInfo, ...]
    op: OpRecord | None
    desired: Desired | None
    records: Mapping[str, EngineRecord]
    placement: Placement | None = None
    placement_rev: int = 0
    kv_figure: int | None = None  # launching mode: the group's smallest published KV figure
    epoch_refused: str | None = None
    op_refused: str | None = None
    desired_refused: str | None = None
    placement_refused: str | None = None


@dataclass(frozen=True)
class Memory:
    """What the leader remembers between ticks (not in etcd)."""

    started_at: float
    launched: Mapping[str, float] = field(default_factory=dict)  # engine id -> launch time
    published: frozenset[str] = frozenset()  # engines whose KV figure is in kv_budget


@dataclass(frozen=True)
class Settings:
    num_experts: int
    rendezvous: str
    leader: str  # this node's id
    initial_engines: int
    block_size: int
    place_engines: bool
    can_launch: bool
    reuse_kv: bool = True
    launch_timeout_s: float = 300.0
    first_epoch_grace_s: float = 120.0
    switch_timeout_s: float = 30.0


# -- actions ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Refused:
    """Log a record that is not acted on (once while it stays the same)."""

    why: str


@dataclass(frozen=True)
class Publish:
    """Publish a profiled engine's KV figure to kv_budget."""

    budget: KVBudget


@dataclass(frozen=True)
class Launched:
    """The leader's memory of launches not yet registered (the others are forgotten)."""

    launched: Mapping[str, float]


@dataclass(frozen=True)
class WritePlacement:
    placement: Placement
    expected_rev: int


@dataclass(frozen=True)
class Launch:
    """Start ``count`` engines with ``kv_cache_bytes`` (None: they profile)."""

    count: int
    kv_cache_bytes: int | None


@dataclass(frozen=True)
class WriteEpoch:
    """Write the planner's next epoch (a fenced CAS on the view's epoch revision)."""

    action: ScaleUp | ScaleDown | Rebalance | Reform
    expected_rev: int


@dataclass(frozen=True)
class AbortSwitch:
    """Abort a failed switch: the abort epoch, the op FAILED, desired rolled back, in one
    fenced transaction."""

    abort: Abort
    expected_rev: int
    op: OpRecord | None
    rolled_back: Desired | None


@dataclass(frozen=True)
class UpdateOp:
    op_id: str
    phase: OpPhase
    progress: str


Action = Union[Refused, Publish, Launched, WritePlacement, Launch, WriteEpoch, AbortSwitch, UpdateOp]


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    summary: str  # what the tick did or waits for (status, logs, tests)


def placement_problem(placement: Placement, nodes: tuple[NodeInfo, ...] | list[NodeInfo]) -> str | None:
    """Why ``placement`` must not be followed (a known node given more than its
    --max-engines, or a target past MAX_ENGINES), or None."""
    by_id = {n.node_id: n for n in nodes}
    if placement.target > MAX_ENGINES or sum(placement.engines.values()) > MAX_ENGINES:
        return f"placement of {placement.target} engines is over {MAX_ENGINES}"
    for nid, count in placement.engines.items():
        if nid in by_id and count > max_engines(by_id[nid]):
            return f"placement gives node {nid} {count} engines, over its --max-engines {max_engines(by_id[nid])}"
    return None


def decide(view: ClusterView, memory: Memory, settings: Settings) -> Decision:
    """The tick's actions (module docstring, steps 1-8)."""
    acts: list[Action] = []

    def done(summary: str) -> Decision:
        return Decision(tuple(acts), summary)

    if view.epoch_refused:  # 1
        acts.append(Refused(view.epoch_refused))
        return done(view.epoch_refused)
    epoch, records, now = view.epoch, view.records, view.now
    op = view.op
    if view.op_refused:  # 2: a bad op record is driven by nobody
        acts.append(Refused(view.op_refused))
        op = None
    desired = view.desired
    cap = capacity(view.nodes) if settings.place_engines else MAX_ENGINES
    bad = view.desired_refused or (desired_problem(desired, cap) if desired is not None and cap > 0 else None)
    if bad:
        acts.append(Refused(f"desired refused: {bad}"))
        size = epoch.world_size if epoch is not None and epoch.ranks else 0
        desired = Desired(num_engines=size, op_id="refused") if size else None
    target = desired.num_engines if desired is not None else settings.initial_engines
    known = {n.addresses.get("rendezvous", "") for n in view.nodes} | {settings.rendezvous}
    if epoch is not None and epoch.ranks and epoch.rendezvous not in known:
        acts.append(Refused(f"epoch {epoch.number}: rendezvous {epoch.rendezvous!r} is no known node's"))

    allowed = None
    if settings.place_engines:  # 3
        placed = _place(view, desired, op, settings, acts)
        if isinstance(placed, str):
            return done(placed)
        target, allowed = placed

    acts.extend(_publications(records, memory, settings, now))  # 4

    launched = {e: t for e, t in memory.launched.items()
                if e not in records and now - t <= settings.launch_timeout_s}
    if launched != dict(memory.launched):
        acts.append(Launched(launched))
    ranks = epoch.ranks if epoch is not None else []
    live = sorted((e for e, r in records.items() if r.state in LIVE_STATES),  # the current ranks in
                  key=lambda e: (ranks.index(e) if e in ranks else len(ranks), e))  # order, then by id
    if settings.can_launch:  # 5
        existing = {e for e, r in records.items()
                    if r.state not in (EngineRecordState.STOPPED, EngineRecordState.FAILED) or e in ranks}
        missing = target - len(existing | set(launched))
        if missing > 0 and all(e in live for e in ranks):
            acts.append(Launch(missing, view.kv_figure if ranks and settings.reuse_kv else None))
            if op is not None:
                acts.append(UpdateOp(op.op_id, OpPhase.LAUNCHING, f"launching {missing} engine(s)"))
            return done(f"launched {missing}")

    num_live = len(live) if allowed is None else len([e for e in live if e in allowed])
    if epoch is None and num_live < target and now - memory.started_at < settings.first_epoch_grace_s:  # 6
        return done(f"waiting for engines: {num_live}/{target} live")

    action = plan_epoch(epoch, target, live, settings.num_experts, now, rendezvous=settings.rendezvous,  # 7
                        leader=settings.leader, allowed=allowed)
    if not isinstance(action, Reform):
        abort = plan_abort(epoch, dict(records), settings.num_experts, now, settings.switch_timeout_s,
                           rendezvous=settings.rendezvous, leader=settings.leader)
        if abort is not None:
            rolled_back = None
            if op is not None and desired is not None and desired.op_id == op.op_id:
                rolled_back = Desired(num_engines=abort.epoch.world_size, op_id=op.op_id,
                                      requested_at=desired.requested_at)
            acts.append(AbortSwitch(abort, view.epoch_rev, op, rolled_back))
            return done(f"Abort of epoch {abort.failed} -> epoch {abort.epoch.number}")
        if isinstance(action, (ScaleUp, ScaleDown, Rebalance)) and epoch is not None \
                and not epoch_served(epoch, dict(records)):
            return done(f"switching to epoch {epoch.number}")
    if isinstance(action, NoChange):  # 8
        if op is not None and epoch is not None and epoch_served(epoch, dict(records)) \
                and epoch.world_size == target:
            acts.append(UpdateOp(op.op_id, OpPhase.DONE, f"serving epoch {epoch.number} with {epoch.world_size} ranks"))
        return done(action.reason)
    kind = type(action).__name__
    acts.append(WriteEpoch(action, view.epoch_rev))
    if op is not None:
        acts.append(UpdateOp(op.op_id, OpPhase.SWITCHING,
                             f"epoch {action.epoch.number}: {kind} to {action.epoch.world_size} ranks"))
    return done(f"{kind} -> epoch {action.epoch.number}")


def _place(view: ClusterView, desired: Desired | None, op: OpRecord | None, settings: Settings,
           acts: list[Action]) -> tuple[int, set[str]] | str:
    """Place the cluster's engines over the nodes (a WritePlacement when it changes);
    returns (engines placed, the engines it keeps), or why nothing is placed now."""
    if settings.leader not in {n.node_id for n in view.nodes}:
        return "placement: waiting for this node's record"  # e.g. just after etcd came back
    current = view.placement
    if view.placement_refused:
        acts.append(Refused(f"placement refused: {view.placement_refused}"))
        current = None
    elif current is not None:
        problem = placement_problem(current, view.nodes)
        if problem:  # not followed: replaced by this leader's own below
            acts.append(Refused(f"placement refused: {problem}"))
            current = None
    target = desired.num_engines if desired is not None else default_target(view.nodes)
    shares, unplaced = place(target, list(view.nodes), current.engines if current is not None else None)
    if current is None or (current.engines, current.target, current.unplaced) != (shares, target, unplaced):
        acts.append(WritePlacement(Placement(engines=shares, target=target, unplaced=unplaced,
                                             leader=settings.leader, created_at=view.now), view.placement_rev))
        if op is not None:
            acts.append(UpdateOp(op.op_id, OpPhase.LAUNCHING,
                                 "placed " + ", ".join(f"{n}: {c}" for n, c in shares.items())
                                 + (f"; {unplaced} engine(s) fit no node's capacity" if unplaced else "")))
    return sum(shares.values()), allowed_engines(shares, view.records.values())


def _publications(records: Mapping[str, EngineRecord], memory: Memory, settings: Settings,
                  now: float) -> list[Publish]:
    out = []
    for eid, r in records.items():
        if eid in memory.published or r.kv_source != "profiled" or r.kv_cache_bytes <= 0:
            continue
        try:
            num_blocks = int(r.addresses.get("num_kv_blocks", "0") or 0)
        except ValueError:
            continue
        if num_blocks > 0:
            out.append(Publish(KVBudget(kv_cache_bytes=r.kv_cache_bytes, block_size=settings.block_size,
                                        num_blocks=num_blocks, engine_id=eid, recorded_at=now)))
    return out
