"""The supervisor's expert-parallel half: what `planaria serve --parallel ep` adds to it.

``Supervisor.ep`` holds one ``EPSupervisor`` in EP mode (None otherwise); the supervisor
calls it where EP differs, and it reaches etcd only through this node's ``EPNode``
(elastic/cluster.py: lease, election, the leader's controller):

- the node's engine slots follow its share of the leader's placement (``slot_changes``:
  decide; the supervisor acts): missing engines are added (lowest free ids), extra ones
  removed (highest ids first, the rule the leader's placement keeps to). A removed engine
  is asked to drain, whatever the supervisor's (possibly newer or older) view of the
  epoch: the engine itself knows whether it is a rank of a group, and a rank leaves only
  at an epoch boundary (elastic/rank_epochs.py), its requests moving to survivors. Until
  the leader has placed this node the node runs its --engines;
- a restarted or added rank takes the group's KV figure (``reused_kv_config``), never
  profiling again;
- a dead engine's etcd record is deleted at once (``forget_engine``), off the loop thread;
- ``planaria scale`` on any node writes the cluster-wide ``desired`` in etcd
  (``scale_to``): the newest request wins, superseding an operation still in progress
  (elastic/desired.py); refused with a clear error while etcd is down;
- ``status`` is the epoch, ranks, placement, nodes, ops and engine records read from etcd,
  and the embedded etcd's own state (``etcd``: daemon/etcd_keeper.py; None with
  --etcd-endpoints), shown even while etcd is unreachable.

Reads that may wait on etcd answer None (or an ``error`` entry) when it is unreachable:
serving never waits on etcd.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from planaria.common.errors import BadArgumentError, ConflictError, UnavailableError
from planaria.daemon.slot import AfterExit

POLL_S = 0.1  # the supervisor's loop looks at the (cached) placement this often


@dataclass
class SlotChanges:
    """What the supervisor does to follow this node's share: add ``num_add`` engines,
    remove the ``remove`` slots (each is asked to drain: a rank of a group leaves at an
    epoch boundary, never mid-collective, and its requests move to survivors)."""

    num_add: int = 0
    remove: list[int] = field(default_factory=list)


class EPSupervisor:
    def __init__(self, node, log, etcd=None) -> None:
        self.node = node  # elastic.cluster.EPNode
        self.log = log
        self.etcd = etcd  # daemon.etcd_keeper.EtcdKeeper of the embedded etcd (None: external)

    @property
    def node_id(self) -> str:
        return self.node.node_id

    def engine_id(self, engine_id: int) -> str:
        """The cluster-wide id of this node's engine ``engine_id`` (etcd engines/<id>)."""
        return f"{self.node_id}-e{engine_id}"

    # -- this node's share -------------------------------------------------------------------
    def share(self) -> int | None:
        """This node's engine count in the leader's placement (None: not placed yet, e.g. a
        node that just joined, whose record the leader has not seen: it keeps its engines)."""
        placement = self.node.placement  # validated by EPNode (elastic/cluster.py) before it is kept
        return placement.engines.get(self.node_id) if placement is not None else None

    def slot_changes(self, slots: dict[int, Any]) -> SlotChanges | None:
        """How the slots (engine id -> daemon.slot.Slot) should change to match the share;
        None when they match (or nothing is placed yet)."""
        share = self.share()
        if share is None:
            return None
        staying = sorted(i for i, s in slots.items() if s.after_exit is not AfterExit.REMOVE)
        if len(staying) < share:
            return SlotChanges(num_add=share - len(staying))
        if len(staying) > share:
            return SlotChanges(remove=staying[share:])
        return None

    # -- KV figures --------------------------------------------------------------------------
    def reused_kv_config(self, figures: list[int]) -> dict[str, Any]:
        """``figures`` (the other serving engines' kv_cache_bytes) and the group's kv_budget
        (EPNode keeps it fresh from etcd off the loop thread): the smallest, as a "reused"
        engine config ({} when there is none)."""
        figures = [f for f in figures if f]
        if getattr(self.node, "kv_figure", None):
            figures.append(self.node.kv_figure)
        return {"kv_cache_bytes": min(figures), "kv_source": "reused"} if figures else {}

    # -- records -----------------------------------------------------------------------------
    def forget_engine(self, engine_id: int, pid: int | None) -> None:
        """Delete a dead engine's etcd record now (its lease would expire anyway), so the
        leader re-forms the group without waiting a TTL; never the record its restarted
        incarnation may have written meanwhile. Off the loop thread: etcd may be down."""
        from planaria.elastic.membership import forget_engine

        eid = self.engine_id(engine_id)

        def delete() -> None:
            try:
                forget_engine(self.node.membership.client, self.node.membership.layout, eid, pid)
            except Exception as exc:  # etcd down: the lease expiry removes it later
                self.log.warning("engine record not deleted", engine=eid, error=str(exc))

        threading.Thread(target=delete, name="ep-forget", daemon=True).start()

    # -- scaling (cluster-wide) ----------------------------------------------------------------
    def engine_count(self) -> int | None:
        """The cluster's engine count: ``desired``, else what the leader placed (its nodes'
        --engines), else None (nothing placed yet). UnavailableError when etcd is down."""
        with _frozen_when_down():
            desired, _ = self.node.controller.desired.read_desired()
        if desired is not None:
            return desired.num_engines
        placement = self.node.placement
        return placement.target if placement is not None else None

    def capacity(self) -> int:
        """The sum of the nodes' --max-engines (from their records)."""
        from planaria.elastic.placement import capacity

        with _frozen_when_down():
            return capacity(self.node.membership.list_nodes())

    def scale_to(self, target: int, local_engines: int) -> dict[str, Any]:
        """Write the cluster-wide ``desired`` (and a pending op); the leader places it and
        each node's supervisor starts or removes its share."""
        current = self.engine_count()
        current = local_engines if current is None else current
        cap = self.capacity()
        if not 1 <= target <= cap:
            raise BadArgumentError(f"engine count must be between 1 and the cluster's capacity {cap} "
                                   f"(the sum of its nodes' --max-engines), got {target}")
        if target == current:
            return {"engines": current, "target": target, "changed": False, "op_id": None}
        op_id = self.request_scale(target)
        self.log.info("scaling the cluster", op_id=op_id, engines=current, target=target)
        return {"engines": current, "target": target, "changed": True, "op_id": op_id,
                "adding": [], "removing": []}

    def request_scale(self, target: int) -> str:
        """Write ``desired`` (and a pending op, superseding one in progress); returns the op id."""
        from planaria.elastic.errors import ScaleConflictError

        try:
            with _frozen_when_down():
                return self.node.request_scale(target)
        except ScaleConflictError as exc:  # desired kept changing under every attempt
            raise ConflictError(f"the scale request did not land: {exc}") from exc

    def reconfigure(self, max_engines: int) -> None:
        """A reload changed --max-engines: the node record carries the new capacity."""
        from planaria.elastic.keys import NodeInfo

        node = self.node
        node.capacity = {**node.capacity, "max_engines": max_engines}

        def write() -> None:
            try:
                node.membership.register_node(NodeInfo(node_id=node.node_id, host=node.host,
                                                       addresses=node.addresses, capacity=node.capacity,
                                                       started_at=node.started_at))
            except Exception as exc:  # etcd down: membership re-writes its keys when it is back
                self.log.warning("node record not updated", error=str(exc))

        threading.Thread(target=write, name="ep-node-record", daemon=True).start()

    # -- status ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Epoch, ranks and the active operation from etcd ({"error": ...} when unreachable),
        and the embedded etcd's process state (``etcd``)."""
        etcd = self.etcd.status() if self.etcd is not None else None
        try:
            epoch = self.node.controller.epochs.read_epoch()[0]
            records = {r.engine_id: r for r in self.node.membership.list_engines()}
            nodes = self.node.membership.list_nodes()
            ops = self.node.controller.desired.list_ops()
            desired, _ = self.node.controller.desired.read_desired()
            placement, _ = self.node.controller.placements.read()
        except Exception as exc:  # etcd down (or a record refused): status still answers
            return {"error": f"etcd unreachable: {exc}", "etcd": etcd}
        active = [o for o in ops if not o.phase.is_final]
        done = [o for o in ops if o.phase.is_final]
        op = min(active, key=lambda o: o.updated_at) if active else None
        last = max(done, key=lambda o: o.updated_at) if done else None

        def op_view(o):
            return None if o is None else {"op_id": o.op_id, "phase": o.phase.value, "progress": o.progress,
                                           "target": o.target, "error": o.error}
        return {"etcd": etcd, "epoch": epoch.number if epoch else None, "world_size": epoch.world_size if epoch else 0,
                "ranks": epoch.ranks if epoch else [], "leader": self.node.election.is_leader,
                "node_id": self.node_id, "desired": desired.num_engines if desired else None,
                "placement": placement.engines if placement else None,
                "unplaced": placement.unplaced if placement else 0,
                "nodes": {n.node_id: {"host": n.host, "http": n.addresses.get("http"),
                                      "engines": n.capacity.get("engines"),
                                      "max_engines": n.capacity.get("max_engines")} for n in nodes},
                "op": op_view(op), "last_op": op_view(last),
                "ops": {o.op_id: op_view(o) for o in ops},  # bounded (elastic/desired.py MAX_KEPT_OPS)
                "engines": {e: {"node_id": r.node_id, "state": r.state.value, "epoch": r.epoch, "rank": r.rank,
                                "kv_source": r.kv_source, "kv_cache_bytes": r.kv_cache_bytes,
                                "failed_epoch": r.failed_epoch, "error": r.error,
                                "transport": str(r.addresses.get("transport", ""))[:16]}
                            for e, r in records.items()}}

    def annotate(self, engines: list[dict[str, Any]], ep: dict[str, Any]) -> None:
        """Each local engine's rank, epoch and record state from ``ep`` (``status()``)."""
        if not ep.get("engines"):
            return
        for e in engines:
            rec = ep["engines"].get(self.engine_id(e["engine_id"]))
            e["rank"] = rec["rank"] if rec else None
            e["epoch"] = rec["epoch"] if rec else None
            e["ep_state"] = rec["state"] if rec else None
            e["transport"] = (rec.get("transport") or None) if rec else None


class _frozen_when_down:
    """etcd errors become UNAVAILABLE: membership changes are frozen, serving goes on."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        from planaria.elastic.errors import EtcdError

        if exc is not None and isinstance(exc, EtcdError):
            raise UnavailableError(f"etcd is unreachable, membership changes are frozen "
                                   f"(serving goes on): {exc}") from exc
        return False
