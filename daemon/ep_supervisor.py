"""The supervisor's expert-parallel half: what `planaria serve --parallel ep` adds to it.

``Supervisor.ep`` holds one ``EPSupervisor`` in EP mode (None otherwise); the supervisor
calls it where EP differs, and it reaches etcd only through this node's ``EPNode``
(elastic/cluster.py: lease, election, the leader's controller):

- a restarted or added rank takes the group's KV figure (``reused_kv_config``), never
  profiling again;
- a dead engine's etcd record is deleted at once (``forget_engine``), off the loop thread;
- ``planaria scale`` writes ``desired`` in etcd (``request_scale``), refused with a clear
  error while another operation runs or etcd is down;
- ``status`` is the epoch, ranks, ops and engine records read from etcd.

Reads that may wait on etcd answer None (or an ``error`` entry) when it is unreachable:
serving never waits on etcd.
"""

from __future__ import annotations

import threading
from typing import Any

from daemon.errors import ConflictError, UnavailableError


class EPSupervisor:
    def __init__(self, node, log) -> None:
        self.node = node  # elastic.cluster.EPNode
        self.log = log

    @property
    def node_id(self) -> str:
        return self.node.node_id

    def engine_id(self, engine_id: int) -> str:
        """The cluster-wide id of this node's engine ``engine_id`` (etcd engines/<id>)."""
        return f"{self.node_id}-e{engine_id}"

    # -- KV figures --------------------------------------------------------------------------
    def reused_kv_config(self, figures: list[int]) -> dict[str, Any]:
        """``figures`` (the other serving engines' kv_cache_bytes) and the group's kv_budget
        (EPNode keeps it fresh from etcd off the loop thread): the smallest, as a "reused"
        engine config ({} when there is none)."""
        figures = [f for f in figures if f]
        if getattr(self.node, "kv_figure", None):
            figures.append(self.node.kv_figure)
        return {"kv_cache_bytes": min(figures), "kv_source": "reused"} if figures else {}

    def group_kv_figure(self) -> int | None:
        """The kv_budget registry's figure for the current group (None: none, or etcd down)."""
        try:
            c = self.node.controller
            epoch = c.epochs.read_epoch()[0]
            budget = c.kv.smallest_for_group(c.fp, c.device_kind, epoch.ranks if epoch else [])
        except Exception as exc:  # etcd down: the engines' own figures still hold
            self.log.warning("kv_budget not read", error=str(exc))
            return None
        return budget.kv_cache_bytes if budget is not None else None

    # -- records -----------------------------------------------------------------------------
    def forget_engine(self, engine_id: int, pid: int | None) -> None:
        """Delete a dead engine's etcd record now (its lease would expire anyway), so the
        leader re-forms the group without waiting a TTL; never the record its restarted
        incarnation may have written meanwhile. Off the loop thread: etcd may be down."""
        from elastic.membership import forget_engine

        eid = self.engine_id(engine_id)

        def delete() -> None:
            try:
                forget_engine(self.node.membership.client, self.node.membership.layout, eid, pid)
            except Exception as exc:  # etcd down: the lease expiry removes it later
                self.log.warning("engine record not deleted", engine=eid, error=str(exc))

        threading.Thread(target=delete, name="ep-forget", daemon=True).start()

    # -- scaling -----------------------------------------------------------------------------
    def desired(self) -> int | None:
        """etcd's desired engine count (None: never set, or etcd unreachable)."""
        try:
            desired, _ = self.node.controller.desired.read_desired()
        except Exception as exc:  # etcd down: request_scale says so if it matters
            self.log.warning("desired not read", error=str(exc))
            return None
        return desired.num_engines if desired is not None else None

    def ranks(self) -> set[str] | None:
        """The engine ids of the current epoch (None when etcd is unreachable)."""
        try:
            epoch = self.node.controller.epochs.read_epoch()[0]
        except Exception as exc:  # etcd down: every engine is assumed to be a rank
            self.log.warning("epoch not read", error=str(exc))
            return None
        return set(epoch.ranks) if epoch is not None else set()

    def request_scale(self, target: int) -> str:
        """Write ``desired`` (and a pending op); returns the op id."""
        from elastic.errors import EtcdError, ScaleConflictError

        try:
            return self.node.request_scale(target)
        except ScaleConflictError as exc:
            raise ConflictError(f"an expert-parallel scale operation is in progress: {exc}") from exc
        except EtcdError as exc:
            raise UnavailableError(f"etcd is unreachable, membership changes are frozen "
                                   f"(serving goes on): {exc}") from exc

    # -- status ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Epoch, ranks and the active operation from etcd ({"error": ...} when unreachable)."""
        try:
            epoch = self.node.controller.epochs.read_epoch()[0]
            records = {r.engine_id: r for r in self.node.membership.list_engines()}
            ops = self.node.controller.desired.list_ops()
        except Exception as exc:  # etcd down: status still answers
            return {"error": f"etcd unreachable: {exc}"}
        active = [o for o in ops if not o.phase.is_final]
        done = [o for o in ops if o.phase.is_final]
        op = min(active, key=lambda o: o.updated_at) if active else None
        last = max(done, key=lambda o: o.updated_at) if done else None

        def op_view(o):
            return None if o is None else {"op_id": o.op_id, "phase": o.phase.value, "progress": o.progress,
                                           "target": o.target, "error": o.error}
        return {"epoch": epoch.number if epoch else None, "world_size": epoch.world_size if epoch else 0,
                "ranks": epoch.ranks if epoch else [], "leader": self.node.election.is_leader,
                "op": op_view(op), "last_op": op_view(last),
                "engines": {e: {"state": r.state.value, "epoch": r.epoch, "rank": r.rank,
                                "kv_source": r.kv_source, "kv_cache_bytes": r.kv_cache_bytes,
                                "failed_epoch": r.failed_epoch, "error": r.error}
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
