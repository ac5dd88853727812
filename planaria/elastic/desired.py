"""The ``desired`` key and ``ops/<op id>`` records of scale operations.

``request_scale(target, op_id)`` is what the admin CLI's ``scale`` reaches (via any
supervisor). ``desired`` is declarative, like a replica count: the newest request wins.
One transaction writes ``desired`` and a PENDING ``ops/<op_id>``, marks the operation
still in progress (if any) CANCELLED "superseded by <op_id>", and deletes the oldest
finished ops beyond ``MAX_KEPT_OPS`` (so ``ops/`` does not grow without bound), with a
compare-and-swap on ``desired`` and on the superseded op, so two concurrent requests
cannot both land on the same state (the loser reads again and supersedes the winner).
At any time at most one op is in progress, and it is ``desired``'s. The leader drives it
through its phases with :meth:`update_op` (fenced by its leader token when given); a
superseded op's switch, if one was under way, finishes first, then the newest target is
planned (one switch at a time).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from planaria.elastic.errors import ElasticError, RecordDecodeError, ScaleConflictError, StaleLeaderError
from planaria.elastic.etcd_client import etcd_call
from planaria.elastic.keys import Desired, KeyLayout, OpPhase, OpRecord, decode, encode
from planaria.elastic.records import read_record

_MAX_ATTEMPTS = 8
MAX_KEPT_OPS = 32  # finished ops kept for status and `scale --wait`; older ones are deleted
_MAX_TXN_ITEMS = 32  # ops superseded or deleted by one request (etcd caps a transaction at 128)


class OpNotFoundError(ElasticError):
    """``ops/<op_id>`` does not exist."""


class DesiredStore:
    def __init__(self, client: Any, cluster: str, *,
                 clock: Callable[[], float] = time.time) -> None:
        self._client = client
        self.layout = KeyLayout(cluster)
        self._clock = clock

    def read_desired(self) -> tuple[Desired | None, int]:
        """``(desired, mod_revision)``; ``(None, 0)`` when never set."""
        return read_record(self._client, self.layout.desired, Desired, "desired")

    def request_scale(self, target: int, op_id: str, kind: str = "scale") -> Desired:
        """Write ``desired`` and a PENDING op; the op in progress, if any, is superseded."""
        if target < 0:
            raise ValueError(f"target must be >= 0, got {target}")
        tx = self._client.transactions
        op_key = self.layout.op(op_id)
        for _attempt in range(_MAX_ATTEMPTS):
            _desired, desired_rev = self.read_desired()
            ops = self._ops_with_revisions()
            now = self._clock()
            desired = Desired(num_engines=target, op_id=op_id, requested_at=now)
            op = OpRecord(op_id=op_id, kind=kind, phase=OpPhase.PENDING, target=target, updated_at=now)
            compare = [tx.mod(self.layout.desired) == desired_rev, tx.create(op_key) == 0]
            success = [tx.put(self.layout.desired, encode(desired)), tx.put(op_key, encode(op))]
            for old, rev in [(o, r) for o, r in ops if not o.phase.is_final][:_MAX_TXN_ITEMS]:
                cancelled = msgspec.structs.replace(old, phase=OpPhase.CANCELLED, updated_at=now,
                                                    error=f"superseded by {op_id} (scale to {target})")
                compare.append(tx.mod(self.layout.op(old.op_id)) == rev)
                success.append(tx.put(self.layout.op(old.op_id), encode(cancelled)))
            finished = sorted((o for o, _rev in ops if o.phase.is_final), key=lambda o: o.updated_at)
            for old in finished[:max(0, len(finished) - MAX_KEPT_OPS + 1)][:_MAX_TXN_ITEMS]:
                success.append(tx.delete(self.layout.op(old.op_id)))
            with etcd_call("request scale"):
                ok, _ = self._client.transaction(compare=compare, success=success, failure=[])
            if ok:
                return desired
            existing = self.get_op(op_id)
            if existing is not None:
                raise ScaleConflictError(op_id, f"{existing.phase.value} (op id reused)")
        raise ScaleConflictError(op_id, "desired kept changing under us")

    def _ops_with_revisions(self) -> list[tuple[OpRecord, int]]:
        """Every op that decodes, with its mod revision (one that does not is driven by
        nobody and superseded by nothing: it is skipped, not trusted)."""
        with etcd_call("list ops"):
            items = list(self._client.get_prefix(self.layout.ops_prefix))
        out = []
        for value, meta in items:
            try:
                out.append((decode(meta.key, value, OpRecord), meta.mod_revision))
            except RecordDecodeError:
                continue
        return out

    def get_op(self, op_id: str) -> OpRecord | None:
        key = self.layout.op(op_id)
        with etcd_call(f"read {key}"):
            value, _meta = self._client.get(key)
        return decode(key, value, OpRecord) if value is not None else None

    def list_ops(self) -> list[OpRecord]:
        with etcd_call("list ops"):
            items = list(self._client.get_prefix(self.layout.ops_prefix))
        return [decode(meta.key, value, OpRecord) for value, meta in items]

    def active_op(self) -> OpRecord | None:
        """The operation not yet in a final phase, if any (the oldest if several)."""
        active = [op for op in self.list_ops() if not op.phase.is_final]
        return min(active, key=lambda op: op.updated_at) if active else None

    def update_op(self, op_id: str, *, phase: OpPhase | None = None, progress: str | None = None,
                  error: str | None = None, kind: str | None = None,
                  leader_create_revision: int | None = None) -> OpRecord:
        """Change fields of ``ops/<op_id>`` (CAS on its mod revision); returns the new record.

        A final phase is final: moving out of it raises ValueError. With
        ``leader_create_revision`` the write is fenced like the epoch's
        (:class:`StaleLeaderError` if the leader key is no longer that term).
        """
        key = self.layout.op(op_id)
        tx = self._client.transactions
        for _attempt in range(_MAX_ATTEMPTS):
            with etcd_call(f"read {key}"):
                value, meta = self._client.get(key)
            if value is None:
                raise OpNotFoundError(op_id)
            current = decode(key, value, OpRecord)
            if current.phase.is_final and phase is not None and phase != current.phase:
                raise ValueError(f"op {op_id} is {current.phase.value}; cannot become {phase.value}")
            updated = OpRecord(
                op_id=op_id, kind=kind if kind is not None else current.kind,
                phase=phase if phase is not None else current.phase, target=current.target,
                progress=progress if progress is not None else current.progress,
                error=error if error is not None else current.error, updated_at=self._clock())
            compare = [tx.mod(key) == meta.mod_revision]
            if leader_create_revision is not None:
                compare.append(tx.create(self.layout.leader) == leader_create_revision)
            with etcd_call(f"update {key}"):
                ok, _ = self._client.transaction(compare=compare,
                                                 success=[tx.put(key, encode(updated))],
                                                 failure=[])
            if ok:
                return updated
            if leader_create_revision is not None:
                with etcd_call("read leader"):
                    leader_value, leader_meta = self._client.get(self.layout.leader)
                leader_rev = leader_meta.create_revision if leader_meta is not None else 0
                if leader_rev != leader_create_revision:
                    raise StaleLeaderError(leader_create_revision,
                                           leader_value.decode() if leader_value else None,
                                           leader_rev)
        raise ScaleConflictError(op_id, "op record kept changing under us")
