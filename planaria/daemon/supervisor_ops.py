"""The supervisor's admin operations (daemon/commands/: restart, drain, scale) and the
engine counts they start from. A mixin of daemon/supervisor.py's Supervisor (its slots,
restart policy, EP supervisor, spawning and stopping)."""

from __future__ import annotations

import itertools
from typing import Any

from planaria.common.errors import BadArgumentError, ConflictError, UnavailableError, UnknownEngineError
from planaria.daemon.launch import engine_key
from planaria.daemon.slot import AfterExit, ScaleOp, Slot, SlotState


class AdminOps:
    def engine(self, engine_id: Any) -> Slot:
        if isinstance(engine_id, bool) or not isinstance(engine_id, int):
            raise BadArgumentError(f"engine id must be an integer, got {engine_id!r}")
        slot = self.engines.get(engine_id)
        if slot is None:
            known = ", ".join(map(str, sorted(self.engines))) or "none"
            raise UnknownEngineError(f"no engine {engine_id} (engines: {known})")
        return slot

    def _check_serving(self) -> None:
        if self.shutting_down:
            raise UnavailableError("the daemon is shutting down")

    def restart_engine(self, engine_id: int) -> dict[str, Any]:
        self._check_serving()
        slot = self.engine(engine_id)
        if slot.state is SlotState.STOPPING:
            raise ConflictError(f"engine {engine_id} is already stopping ({slot.after_exit.value})")
        if slot.child is not None:
            self._stop(slot, AfterExit.RESTART)
        else:
            self._spawn(slot)
        self._notify_status()
        return {"engine_id": engine_id, "state": slot.state.value}

    def drain_engine(self, engine_id: int) -> dict[str, Any]:
        self._check_serving()
        slot = self.engine(engine_id)
        if slot.state is SlotState.DRAINED or slot.after_exit is AfterExit.DRAIN:
            return {"engine_id": engine_id, "state": slot.state.value, "changed": False}
        if slot.state is SlotState.STOPPING:
            raise ConflictError(f"engine {engine_id} is already stopping ({slot.after_exit.value})")
        if slot.child is not None:
            self._stop(slot, AfterExit.DRAIN)
        else:
            slot.state, slot.due_at, slot.reason = SlotState.DRAINED, None, "drained"
        self._notify_status()
        return {"engine_id": engine_id, "state": slot.state.value, "changed": True}

    def _kv_figures(self, but: Slot | None = None) -> list[int]:
        """The kv_cache_bytes of the serving engines (other than ``but``)."""
        beats = [s.current.heartbeat for s in self.engines.values()
                 if s is not but and s.state is SlotState.RUNNING and s.current is not None]
        return [hb.kv_cache_bytes for hb in beats if hb is not None and hb.kv_cache_bytes > 0]

    def reused_kv_cache_bytes(self) -> int | None:
        """The smallest kv_cache_bytes of the serving engines (a scale-up reuses it; in EP
        mode ``EPSupervisor.reused_kv_config`` adds the group's kv_budget figure)."""
        figures = self._kv_figures()
        return min(figures) if figures else None

    def engine_count(self) -> int:
        """The engine count `scale up|down` starts from: this daemon's engines, or in EP
        mode the cluster's (its desired count)."""
        count = self.ep.engine_count() if self.ep is not None else None
        return len(self.engines) if count is None else count

    def scale_to(self, target: Any) -> dict[str, Any]:
        self._check_serving()
        if isinstance(target, bool) or not isinstance(target, int):
            raise BadArgumentError(f"engine count must be an integer, got {target!r}")
        if self.ep is not None:  # EP: cluster-wide; the leader places it over the nodes
            if target < 1:
                raise BadArgumentError(f"engine count must be between 1 and the cluster's capacity, got {target}")
            return self.ep.scale_to(target, len(self.engines))
        if not 1 <= target <= self.config.max_engines:
            raise BadArgumentError(f"engine count must be between 1 and the capacity "
                                   f"--max-engines={self.config.max_engines}, got {target}")
        if self.scale_op is not None:
            raise ConflictError(f"scale operation {self.scale_op.op_id} (to "
                                f"{self.scale_op.target}) is still in progress")
        current = len(self.engines)
        if target == current:
            return {"engines": current, "target": target, "changed": False, "op_id": None}
        op = ScaleOp(next(self._op_ids), target, adding=[], removing=[])
        if target > current:
            kv = self.reused_kv_cache_bytes()
            op.adding = self._add_engines(target - current, {"kv_cache_bytes": kv, "kv_source": "reused"}
                                          if kv else {})
        else:
            op.removing = sorted(self.engines)[target:]
            for engine_id in op.removing:
                self._remove_engine(engine_id)
        self.scale_op = op
        self.log.info("scaling", op_id=op.op_id, engines=current, target=target,
                      adding=op.adding, removing=op.removing)
        self._update_scale_op()
        self._notify_status()
        return {"engines": current, "target": target, "changed": True, "op_id": op.op_id,
                "adding": op.adding, "removing": op.removing}

    def _add_engines(self, num: int, extra_config: dict[str, Any]) -> list[int]:
        """Start ``num`` engines in the lowest free slots; returns their ids."""
        added = list(itertools.islice((i for i in itertools.count() if i not in self.engines), num))
        for engine_id in added:
            slot = self.engines[engine_id] = Slot(engine_key(engine_id), extra_config=dict(extra_config))
            self._spawn(slot)
        return added

    def _remove_engine(self, engine_id: int) -> None:
        """Remove an engine: drained and stopped (an EP rank drains by leaving its group at
        an epoch boundary, its requests moving to survivors); the slot goes when it exits."""
        slot = self.engines[engine_id]
        if slot.child is None:
            del self.engines[engine_id]
            self.policy.forget(slot.key)
        elif slot.state is SlotState.STOPPING:
            slot.current.after_exit = AfterExit.REMOVE  # on its way out already
        else:
            self._stop(slot, AfterExit.REMOVE)  # drains its requests first

    def _follow_placement(self) -> None:
        """EP: start or remove engines to match this node's share of the placement."""
        changes = self.ep.slot_changes(self.engines)
        if changes is None:
            return
        added = self._add_engines(changes.num_add, self.ep.reused_kv_config(self._kv_figures()))
        for engine_id in changes.remove:
            self._remove_engine(engine_id)
        self.log.info("following the placement", share=self.ep.share(), added=added, removing=changes.remove)
        self._notify_status()

    def ep_status(self) -> dict[str, Any] | None:
        """Epoch, ranks and the active operation from etcd (None when not EP)."""
        return self.ep.status() if self.ep is not None else None

    def _update_scale_op(self) -> None:
        op = self.scale_op
        if op is None:
            return
        pending = [i for i in op.adding if i in self.engines and self.engines[i].state in (
            SlotState.STARTING, SlotState.BACKOFF, SlotState.WAITING)]
        pending += [i for i in op.removing if i in self.engines]
        if not pending:
            self.log.info("scale done", op_id=op.op_id, engines=len(self.engines))
            self.scale_op = None
