"""The leader's executor for expert-parallel clusters: make the epoch follow `desired`.

Each ``tick`` observes, decides, then acts, as torch.distributed.elastic's agent does:

- ``observe`` reads the cluster once into a frozen ``ClusterView`` (elastic/reconcile.py),
  in this order:

  1. ``epoch`` with its mod revision (the compare-and-swap base of any epoch write this
     tick: an epoch written by anyone after this read makes that write fail, so a
     decision on a stale epoch never lands);
  2. the node records;
  3. ``desired``, then the op it names (``ops/<desired.op_id>``, in progress unless in a
     final phase): a scale request writes both in one transaction, so the op read is
     the one paired with the size read, or, when a newer request landed between the two
     reads, an op it superseded (final: not driven). Reading "the active op" and
     ``desired`` as two unrelated records once paired a request landing between the
     reads with the old size, and the op was marked DONE at the size the cluster already
     had. One read of one key, however many finished ops etcd keeps;
  4. ``placement`` with its mod revision (``planaria serve``: placed mode);
  5. the group's KV figure (launching mode only);
  6. the engine records, last: the freshest picture of what the engines report.

  A record that fails its checks (elastic/keys.py) is kept out of the view with the
  reason, never half-read.
- ``reconcile.decide(view, memory, settings)`` is pure: it returns the actions (refusals
  to log, KV figures to publish, a placement, launches, an epoch, an abort, op updates)
  and a one-line summary. Its rules, in order, are in its module docstring.
- ``_act`` carries them out in order and stops at the first write that fails (a fenced
  write refused because another leader or another write got there first: the next tick
  decides again on a fresh view).

Launching mode (tests/elastic/_deployment.py, for tests and bench/): too few engines for
`desired` are launched through the injected ``launch(engine_id, kv_cache_bytes)``; a
scale-up launch passes the smallest published KV figure of the group, so the new engine
skips profiling. Placed mode
(``planaria serve``: every supervisor starts its own engines): the controller launches
nothing; it places ``desired`` over the nodes (elastic/placement.py), writes the
``placement`` key (fenced like the epoch) and plans epochs over the engines it keeps;
when ``desired`` was never set, the target is the sum of the nodes' ``--engines``.

The op record (``ops/<id>``) follows: LAUNCHING -> SWITCHING -> DONE once every rank of
the new epoch serves it. A switch that fails (a rank reports ``failed_epoch``) or is not
served within ``switch_timeout_s`` is aborted: one fenced transaction writes the next
epoch at the largest healthy set, the op as FAILED with the reason, and ``desired`` back
to that size, so serving goes on and a later ``scale`` is free to try again.

Records read from etcd are checked before they are acted on: an epoch that is not
self-consistent or does not cover the model's experts, a desired size not within [1, the
cluster's capacity], a placement giving a node more than its --max-engines, are refused
with an error in the log and not acted on. An epoch whose rendezvous is no known node's
is logged as an error, not refused (after a failover the old leader's node is gone while
its group serves on; engines check it before joining).
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import structlog

from planaria.elastic.desired import DesiredStore
from planaria.elastic.epochs import EpochStore
from planaria.elastic.errors import ElasticError, RecordDecodeError
from planaria.elastic.etcd_client import etcd_call
from planaria.elastic.keys import OpPhase, OpRecord, encode, epoch_problem
from planaria.elastic.kv_budget import KVBudgetRegistry
from planaria.elastic.placement import PlacementStore
from planaria.elastic.reconcile import (AbortSwitch, Action, ClusterView, Launch, Launched, Memory, Publish,
                                        Refused, Settings, UpdateOp, WriteEpoch, WritePlacement, decide,
                                        placement_problem)

log = structlog.get_logger("planaria.elastic.controller")

__all__ = ["EPController", "placement_problem"]


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

    def settings(self) -> Settings:
        return Settings(num_experts=self.num_experts, rendezvous=self.rendezvous, leader=self.membership.node_id,
                        initial_engines=self.initial_engines, block_size=self.block_size,
                        place_engines=self.place_engines, can_launch=self.launch is not None,
                        reuse_kv=self.reuse_kv, launch_timeout_s=self.launch_timeout_s,
                        first_epoch_grace_s=self.first_epoch_grace_s, switch_timeout_s=self.switch_timeout_s)

    def tick(self) -> str:
        """Observe, decide, act (module docstring); returns what the tick did or waits for."""
        if not self.election.is_leader:
            return "not leader"
        view = self.observe()
        decision = decide(view, Memory(self.started_at, dict(self._launched), frozenset(self._published)),
                          self.settings())
        self.last_action = self._act(decision.actions, view) or decision.summary
        return self.last_action

    # -- observe -------------------------------------------------------------------------------
    def observe(self) -> ClusterView:
        """Read the cluster once, in the order of the module docstring."""
        now = self.clock()
        try:  # 1. the epoch
            epoch, epoch_rev = self.epochs.read_epoch()
            problem = epoch_problem(epoch, num_experts=self.num_experts) if epoch is not None else None
            epoch_refused = f"epoch {epoch.number} refused: {problem}" if problem else None
        except RecordDecodeError as exc:
            epoch, epoch_rev, epoch_refused = None, 0, f"epoch refused: {exc}"
        if epoch_refused:
            return ClusterView(now=now, epoch=None, epoch_rev=epoch_rev, nodes=(), op=None, desired=None,
                               records={}, epoch_refused=epoch_refused)
        nodes = tuple(self.membership.list_nodes())  # 2. the nodes
        op_refused = desired_refused = placement_refused = None
        op = None
        try:  # 3. desired, then the op it names
            desired, _rev = self.desired.read_desired()
        except RecordDecodeError as exc:
            desired, desired_refused = None, str(exc)
        if desired is not None:
            try:
                op = self.desired.get_op(desired.op_id)
            except RecordDecodeError as exc:
                op_refused = f"op refused: {exc}"
            if op is not None and op.phase.is_final:
                op = None
        placement, placement_rev = None, 0
        if self.place_engines:  # 4. the placement
            try:
                placement, placement_rev = self.placements.read()
            except RecordDecodeError as exc:
                placement_refused, placement_rev = str(exc), self._placement_revision()
        kv_figure = None
        if self.launch is not None and self.reuse_kv and epoch is not None and epoch.ranks:  # 5.
            budget = self.kv.smallest_for_group(self.fp, self.device_kind, epoch.ranks)
            kv_figure = budget.kv_cache_bytes if budget is not None else None
        records = {r.engine_id: r for r in self.membership.list_engines()}  # 6. the engines, last
        return ClusterView(now=now, epoch=epoch, epoch_rev=epoch_rev, nodes=nodes, op=op, desired=desired,
                           records=records, placement=placement, placement_rev=placement_rev,
                           kv_figure=kv_figure, op_refused=op_refused, desired_refused=desired_refused,
                           placement_refused=placement_refused)

    def _placement_revision(self) -> int:
        """The placement key's mod revision (for the CAS that replaces a refused value)."""
        client, key = self.membership.client, self.placements.layout.placement
        with etcd_call("read placement"):
            _value, meta = client.get(key)
        return meta.mod_revision if meta is not None else 0

    # -- act -----------------------------------------------------------------------------------
    def _act(self, actions: tuple[Action, ...], view: ClusterView) -> str | None:
        """Carry out ``actions`` in order; the first write that fails ends the tick, and its
        text replaces the decision's summary."""
        for action in actions:
            match action:
                case Refused(why=why):
                    self._log_refusal(why)
                case Publish(budget=budget):
                    try:
                        self.kv.publish(self.fp, self.device_kind, budget)
                        self._published.add(budget.engine_id)
                    except ElasticError as exc:
                        log.warning("kv budget not published", error=str(exc))
                case Launched(launched=launched):
                    self._launched = dict(launched)
                case Launch(count=count, kv_cache_bytes=kv):
                    for _ in range(count):
                        eid = self.next_engine_id()
                        self._launched[eid] = view.now
                        self.launch(eid, kv)
                case WritePlacement(placement=placement, expected_rev=rev):
                    try:
                        self.placements.write(placement, rev, self.election.leader_revision or 0)
                    except ElasticError as exc:
                        log.warning("placement write refused", error=str(exc))
                        return f"placement write refused: {exc}"
                    log.info("placement written", engines=placement.engines, target=placement.target,
                             unplaced=placement.unplaced)
                case WriteEpoch(action=plan, expected_rev=rev):
                    try:
                        self.epochs.write_epoch(plan.epoch, rev, self.election.leader_revision or 0)
                    except ElasticError as exc:
                        log.warning("epoch write refused", error=str(exc))
                        return f"epoch write refused: {exc}"
                    log.info("epoch written", number=plan.epoch.number, kind=type(plan).__name__,
                             ranks=plan.epoch.ranks)
                case AbortSwitch():
                    failed = self._abort(action, view.now)
                    if failed:
                        return failed
                case UpdateOp(op_id=op_id, phase=phase, progress=progress):
                    self._update_op(op_id, phase, progress)
        return None

    def _log_refusal(self, why: str) -> None:
        """Log a refused record once while it stays the same."""
        if why not in self._refusals:
            log.error("record refused; not acted on", reason=why)
            if len(self._refusals) > 100:
                self._refusals.clear()
            self._refusals.add(why)

    def _abort(self, action: AbortSwitch, now: float) -> str | None:
        """The abort epoch, the op FAILED and desired rolled back, in one fenced transaction;
        the failure text when the write was refused."""
        abort, op, layout = action.abort, action.op, self.desired.layout
        puts = []
        if op is not None:
            failed = OpRecord(op_id=op.op_id, kind=op.kind, phase=OpPhase.FAILED, target=op.target,
                              progress=f"aborted epoch {abort.failed}; re-formed at epoch {abort.epoch.number} "
                                       f"with {abort.epoch.world_size} rank(s)",
                              error=abort.reason, updated_at=now)
            puts.append((layout.op(op.op_id), encode(failed)))
        if action.rolled_back is not None:
            puts.append((layout.desired, encode(action.rolled_back)))
        try:
            self.epochs.write_epoch(abort.epoch, action.expected_rev, self.election.leader_revision or 0, puts)
        except ElasticError as exc:
            log.warning("abort epoch write refused", error=str(exc))
            return f"epoch write refused: {exc}"
        log.warning("switch aborted", failed_epoch=abort.failed, number=abort.epoch.number,
                    ranks=abort.epoch.ranks, excluded=abort.excluded, reason=abort.reason,
                    op_id=op.op_id if op is not None else None)
        return None

    def _update_op(self, op_id: str, phase: OpPhase, progress: str) -> None:
        try:
            self.desired.update_op(op_id, phase=phase, progress=progress,
                                   leader_create_revision=self.election.leader_revision)
        except (ElasticError, ValueError) as exc:  # ValueError: it went final meanwhile
            log.warning("op record not updated", op_id=op_id, error=str(exc))
