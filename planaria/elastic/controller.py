"""The leader's executor for expert-parallel clusters: make the epoch follow `desired`.

Each ``tick`` reads the cluster (epoch, desired, engine records), asks the pure planner
(elastic/planner.py) what to do, and acts:

- too few engines exist for `desired`: launch the missing ones through the injected
  ``launch(engine_id, kv_cache_bytes)``; a scale-up launch passes the smallest published
  KV figure of the group (kv_budget), so the new engine skips profiling ("reused");
- ScaleUp / ScaleDown / Reform: write the next epoch with the fenced compare-and-swap
  (only the current leader's write can land); engines watch the key and switch at a step
  boundary; departing engines hand their requests to survivors and exit;
- the op record (`ops/<id>`) follows: LAUNCHING -> SWITCHING -> DONE once every rank
  of the new epoch reports it serves that epoch;
- one switch at a time: no scale-up or scale-down is planned while the current epoch is
  not yet served by all its ranks (a Reform for a dead rank still is);
- a switch that fails (a rank reports ``failed_epoch``) or is not served within
  ``switch_timeout_s`` is aborted (planner.plan_abort): one fenced transaction writes the
  next epoch at the largest healthy set (the old membership), the op as FAILED with the
  reason, and ``desired`` back to that size, so serving goes on and a later ``scale`` is
  free to try again.

With ``place_engines`` (``planaria serve``: every supervisor starts its own engines) the
controller launches nothing: it places ``desired`` over the nodes (elastic/placement.py),
writes the ``placement`` key (fenced like the epoch) for the supervisors to reconcile
their engine slots to, and plans epochs over the engines that placement keeps. When
``desired`` was never set, the target is the sum of the nodes' ``--engines``.

The first profiled engines' figures are published to kv_budget here as they appear.

Records read from etcd are checked before they are acted on (elastic/keys.py): an epoch
that is not self-consistent or does not cover the model's experts, a desired size not
within [1, the cluster's capacity], a placement giving a node more than its
--max-engines, are refused with an error in the log and not acted on (the leader keeps
the cluster as it is: a bad ``desired`` counts as the current world size; a bad
placement is replaced by the leader's own). An epoch whose rendezvous is no known node's
is logged as an error; it is not refused here, since after a failover the old leader's
node is gone while its group serves on (engines are the ones to check it before joining).
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import structlog

from planaria.elastic.desired import DesiredStore
from planaria.elastic.epochs import EpochStore
from planaria.elastic.errors import ElasticError, RecordDecodeError
from planaria.elastic.keys import (MAX_ENGINES, Desired, EngineRecordState, KVBudget, NodeInfo, OpPhase,
                                   OpRecord, desired_problem, encode, epoch_problem)
from planaria.elastic.kv_budget import KVBudgetRegistry
from planaria.elastic.placement import (Placement, PlacementStore, allowed_engines, capacity, default_target,
                                        max_engines, place)
from planaria.elastic.planner import (LIVE_STATES, Abort, NoChange, Rebalance, Reform, ScaleDown, ScaleUp,
                             epoch_served, plan_abort, plan_epoch)

log = structlog.get_logger("planaria.elastic.controller")


def placement_problem(placement: Placement, nodes: list[NodeInfo]) -> str | None:
    """Why ``placement`` must not be followed (a known node given more than its
    --max-engines, or a target past MAX_ENGINES), or None."""
    by_id = {n.node_id: n for n in nodes}
    if placement.target > MAX_ENGINES or sum(placement.engines.values()) > MAX_ENGINES:
        return f"placement of {placement.target} engines is over {MAX_ENGINES}"
    for nid, count in placement.engines.items():
        if nid in by_id and count > max_engines(by_id[nid]):
            return f"placement gives node {nid} {count} engines, over its --max-engines {max_engines(by_id[nid])}"
    return None


class EPController:
    def __init__(self, membership, election, cluster: str, *, num_experts: int, rendezvous: str,
                 launch: Callable[[str, int | None], None] | None, model_fingerprint: str, device_kind: str,
                 block_size: int, initial_engines: int, engine_prefix: str = "",
                 launch_timeout_s: float = 300.0, first_epoch_grace_s: float = 120.0,
                 switch_timeout_s: float = 30.0, place_engines: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        client = membership.client
        self.membership, self.election = membership, election
        self.epochs = EpochStore(client, cluster)
        self.desired = DesiredStore(client, cluster)
        self.kv = KVBudgetRegistry(client, cluster)
        self.placements = PlacementStore(client, cluster)
        self.place_engines = place_engines
        self.num_experts, self.rendezvous = num_experts, rendezvous
        self.launch = launch
        self.fp, self.device_kind, self.block_size = model_fingerprint, device_kind, block_size
        self.initial_engines = initial_engines
        self.engine_prefix = engine_prefix or f"{membership.node_id}-e"
        self.launch_timeout_s, self.first_epoch_grace_s = launch_timeout_s, first_epoch_grace_s
        self.switch_timeout_s = switch_timeout_s
        self.clock = clock
        self.started_at = clock()
        self._launched: dict[str, float] = {}  # engine id -> launch time (not yet registered)
        self._counter = itertools.count()
        self._published: set[str] = set()
        self.last_action = "idle"
        self._refusals: set[str] = set()  # logged already
        self.reuse_kv = True  # False: scale-up engines profile (bench/scale_up.py compares)

    def next_engine_id(self) -> str:
        return f"{self.engine_prefix}{next(self._counter)}"

    def tick(self) -> str:
        if not self.election.is_leader:
            return "not leader"
        now = self.clock()
        try:
            epoch, epoch_rev = self.epochs.read_epoch()
        except RecordDecodeError as exc:
            return self._refuse(f"epoch refused: {exc}")
        if epoch is not None:
            problem = epoch_problem(epoch, num_experts=self.num_experts)
            if problem:
                return self._refuse(f"epoch {epoch.number} refused: {problem}")
        nodes = self.membership.list_nodes()
        # The op before ``desired``: a scale request writes both in one transaction, so an op
        # read first comes with its own desired (or a later one). Read the other way round, a
        # request landing between the reads pairs the new op with the old size, and the
        # NoChange branch below marks it DONE at the size the cluster already has.
        try:
            op = self.desired.active_op()
        except RecordDecodeError as exc:  # a bad op record: driven by nobody
            op = self._refuse(f"op refused: {exc}") and None
        try:
            desired, _desired_rev = self.desired.read_desired()
            cap = capacity(nodes) if self.place_engines else MAX_ENGINES
            bad = desired_problem(desired, cap) if desired is not None and cap > 0 else None
        except RecordDecodeError as exc:
            desired, bad = None, str(exc)
        if bad:  # not acted on: the cluster stays at its size
            self._refuse(f"desired refused: {bad}")
            size = epoch.world_size if epoch is not None and epoch.ranks else 0
            desired = Desired(num_engines=size, op_id="refused") if size else None
        target = desired.num_engines if desired is not None else self.initial_engines
        records = {r.engine_id: r for r in self.membership.list_engines()}
        known = {n.addresses.get("rendezvous", "") for n in nodes} | {self.rendezvous}
        if epoch is not None and epoch.ranks and epoch.rendezvous not in known:
            # Logged, not refused: after a failover the old leader's node (and store) is gone
            # while its group goes on serving; the next epoch is at this leader's rendezvous.
            self._refuse(f"epoch {epoch.number}: rendezvous {epoch.rendezvous!r} is no known node's")
        allowed = None
        if self.place_engines:
            placed = self._place(desired, records, op, now, nodes)
            if isinstance(placed, str):
                self.last_action = placed
                return placed
            target, allowed = placed
        self._publish_profiled(records, now)
        for eid in [e for e, t in self._launched.items() if e in records or now - t > self.launch_timeout_s]:
            self._launched.pop(eid)
        live = [e for e, r in records.items() if r.state in LIVE_STATES]
        ranks = epoch.ranks if epoch is not None else []
        # Prefer the current ranks in their order, then newcomers by id.
        live.sort(key=lambda e: (ranks.index(e) if e in ranks else len(ranks), e))

        existing = [e for e, r in records.items() if r.state not in (EngineRecordState.STOPPED, EngineRecordState.FAILED)
                    or e in ranks]
        missing = target - len(set(existing) | set(self._launched))
        if self.launch is None:
            missing = 0  # engines are started by their supervisors (planaria serve --parallel ep)
        if missing > 0 and not any(e not in live for e in ranks):
            budget = self.kv.smallest_for_group(self.fp, self.device_kind, ranks) if ranks and self.reuse_kv else None
            for _ in range(missing):
                eid = self.next_engine_id()
                self._launched[eid] = now
                self.launch(eid, budget.kv_cache_bytes if budget is not None else None)
            self._op(op, OpPhase.LAUNCHING, f"launching {missing} engine(s)")
            self.last_action = f"launched {missing}"
            return self.last_action

        num_live = len(live) if allowed is None else len([e for e in live if e in allowed])
        if epoch is None and num_live < target and now - self.started_at < self.first_epoch_grace_s:
            return f"waiting for engines: {num_live}/{target} live"
        action = plan_epoch(epoch, target, live, self.num_experts, now, rendezvous=self.rendezvous,
                            leader=self.membership.node_id, allowed=allowed)
        if not isinstance(action, Reform):
            abort = plan_abort(epoch, records, self.num_experts, now, self.switch_timeout_s,
                               rendezvous=self.rendezvous, leader=self.membership.node_id)
            if abort is not None:
                return self._abort(abort, epoch_rev, op, desired, now)
            if isinstance(action, (ScaleUp, ScaleDown, Rebalance)) and epoch is not None \
                    and not epoch_served(epoch, records):
                self.last_action = f"switching to epoch {epoch.number}"
                return self.last_action
        if isinstance(action, NoChange):
            if op is not None and epoch is not None and epoch_served(epoch, records) \
                    and epoch.world_size == target:
                self._op(op, OpPhase.DONE, f"serving epoch {epoch.number} with {epoch.world_size} ranks")
            self.last_action = action.reason
            return action.reason
        try:
            self.epochs.write_epoch(action.epoch, epoch_rev, self.election.leader_revision or 0)
        except ElasticError as exc:
            log.warning("epoch write refused", error=str(exc))
            self.last_action = f"epoch write refused: {exc}"
            return self.last_action
        kind = type(action).__name__
        self._op(op, OpPhase.SWITCHING, f"epoch {action.epoch.number}: {kind} to {action.epoch.world_size} ranks")
        log.info("epoch written", number=action.epoch.number, kind=kind, ranks=action.epoch.ranks)
        self.last_action = f"{kind} -> epoch {action.epoch.number}"
        return self.last_action

    def _refuse(self, why: str) -> str:
        """Log a refused record (once while it stays the same) and say so in last_action."""
        if why not in self._refusals:
            log.error("record refused; not acted on", reason=why)
            if len(self._refusals) > 100:
                self._refusals.clear()
            self._refusals.add(why)
        self.last_action = why
        return why

    def _place(self, desired: Desired | None, records, op, now: float,
               nodes: list[NodeInfo]) -> tuple[int, set[str]] | str:
        """Place the cluster's engines over the nodes and write ``placement`` when it changes;
        returns (engines placed, the engines it keeps), or why nothing is placed now."""
        if self.membership.node_id not in {n.node_id for n in nodes}:
            return "placement: waiting for this node's record"  # e.g. just after etcd came back
        try:
            current, rev = self.placements.read()
        except RecordDecodeError as exc:
            self._refuse(f"placement refused: {exc}")
            current, rev = None, self._placement_revision()
        if current is not None:
            problem = placement_problem(current, nodes)
            if problem:  # not followed: replaced by this leader's own below
                self._refuse(f"placement refused: {problem}")
                current = None
        target = desired.num_engines if desired is not None else default_target(nodes)
        shares, unplaced = place(target, nodes, current.engines if current is not None else None)
        if current is None or (current.engines, current.target, current.unplaced) != (shares, target, unplaced):
            new = Placement(engines=shares, target=target, unplaced=unplaced, leader=self.membership.node_id,
                            created_at=now)
            try:
                self.placements.write(new, rev, self.election.leader_revision or 0)
            except ElasticError as exc:
                log.warning("placement write refused", error=str(exc))
                return f"placement write refused: {exc}"
            log.info("placement written", engines=shares, target=target, unplaced=unplaced)
            self._op(op, OpPhase.LAUNCHING, "placed " + ", ".join(f"{n}: {c}" for n, c in shares.items())
                     + (f"; {unplaced} engine(s) fit no node's capacity" if unplaced else ""))
        return sum(shares.values()), allowed_engines(shares, records.values())

    def _placement_revision(self) -> int:
        """The placement key's mod revision (for the CAS that replaces a refused value)."""
        from planaria.elastic.etcd_client import etcd_call

        client, key = self.membership.client, self.placements.layout.placement
        with etcd_call("read placement"):
            _value, meta = client.get(key)
        return meta.mod_revision if meta is not None else 0

    def _abort(self, abort: Abort, epoch_rev: int, op, desired: Desired | None, now: float) -> str:
        """Abort a failed switch: the next epoch at the healthy set, the op FAILED and
        ``desired`` back to that size, in one fenced transaction."""
        layout = self.desired.layout
        puts = []
        if op is not None:
            failed = OpRecord(op_id=op.op_id, kind=op.kind, phase=OpPhase.FAILED, target=op.target,
                              progress=f"aborted epoch {abort.failed}; re-formed at epoch {abort.epoch.number} "
                                       f"with {abort.epoch.world_size} rank(s)",
                              error=abort.reason, updated_at=now)
            puts.append((layout.op(op.op_id), encode(failed)))
            if desired is not None and desired.op_id == op.op_id:
                rolled_back = Desired(num_engines=abort.epoch.world_size, op_id=op.op_id,
                                      requested_at=desired.requested_at)
                puts.append((layout.desired, encode(rolled_back)))
        try:
            self.epochs.write_epoch(abort.epoch, epoch_rev, self.election.leader_revision or 0, puts)
        except ElasticError as exc:
            log.warning("abort epoch write refused", error=str(exc))
            self.last_action = f"epoch write refused: {exc}"
            return self.last_action
        log.warning("switch aborted", failed_epoch=abort.failed, number=abort.epoch.number,
                    ranks=abort.epoch.ranks, excluded=abort.excluded, reason=abort.reason,
                    op_id=op.op_id if op is not None else None)
        self.last_action = f"Abort of epoch {abort.failed} -> epoch {abort.epoch.number}"
        return self.last_action

    def _publish_profiled(self, records, now: float) -> None:
        for eid, r in records.items():
            if eid in self._published or r.kv_source != "profiled" or r.kv_cache_bytes <= 0:
                continue
            num_blocks = int(r.addresses.get("num_kv_blocks", "0") or 0)
            if num_blocks <= 0:
                continue
            try:
                self.kv.publish(self.fp, self.device_kind, KVBudget(
                    kv_cache_bytes=r.kv_cache_bytes, block_size=self.block_size,
                    num_blocks=num_blocks, engine_id=eid, recorded_at=now))
                self._published.add(eid)
            except ElasticError as exc:
                log.warning("kv budget not published", error=str(exc))

    def _op(self, op, phase: OpPhase, progress: str) -> None:
        if op is None:
            return
        try:
            self.desired.update_op(op.op_id, phase=phase, progress=progress,
                                   leader_create_revision=self.election.leader_revision)
        except ElasticError as exc:
            log.warning("op record not updated", op_id=op.op_id, error=str(exc))
