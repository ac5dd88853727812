"""The KV-budget registry: ``kv_budget/<model fingerprint>/<device kind>``.

The first engines of a cluster profile memory and :meth:`KVBudgetRegistry.publish` their
figure; the registry keeps the *smallest* one (a compare-and-swap loop, so concurrent
publishers cannot lose a smaller figure). An engine launched for a scale-up asks
:meth:`smallest_for_group` instead of profiling, and gets a figure every member of the
current group can honour.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from planaria.elastic.errors import ElasticError
from planaria.elastic.etcd_client import etcd_call
from planaria.elastic.keys import EngineRecord, KeyLayout, KVBudget, decode, encode


class KVBudgetContentionError(ElasticError):
    """The compare-and-swap loop lost ``max_attempts`` times in a row."""


class KVBudgetRegistry:
    def __init__(self, client: Any, cluster: str, *, max_attempts: int = 16,
                 clock: Callable[[], float] = time.time) -> None:
        self._client = client
        self.layout = KeyLayout(cluster)
        self._max_attempts = max_attempts
        self._clock = clock

    def publish(self, model_fingerprint: str, device_kind: str, budget: KVBudget) -> KVBudget:
        """Record ``budget`` unless a figure at most as large is there; returns the winner."""
        if budget.kv_cache_bytes <= 0 or budget.num_blocks <= 0 or budget.block_size <= 0:
            raise ValueError(f"KV budget must be positive, got {budget}")
        key = self.layout.kv_budget(model_fingerprint, device_kind)
        tx = self._client.transactions
        for _attempt in range(self._max_attempts):
            with etcd_call(f"read {key}"):
                value, meta = self._client.get(key)
            if value is None:
                compare = [tx.create(key) == 0]
            else:
                current = decode(key, value, KVBudget)
                if current.kv_cache_bytes <= budget.kv_cache_bytes:
                    return current
                compare = [tx.mod(key) == meta.mod_revision]
            with etcd_call(f"publish {key}"):
                ok, _ = self._client.transaction(compare=compare,
                                                 success=[tx.put(key, encode(budget))],
                                                 failure=[])
            if ok:
                return budget
        raise KVBudgetContentionError(f"{key}: lost {self._max_attempts} CAS rounds")

    def lookup(self, model_fingerprint: str, device_kind: str) -> KVBudget | None:
        key = self.layout.kv_budget(model_fingerprint, device_kind)
        with etcd_call(f"read {key}"):
            value, _meta = self._client.get(key)
        return decode(key, value, KVBudget) if value is not None else None

    def smallest_for_group(self, model_fingerprint: str, device_kind: str,
                           engine_ids: Iterable[str]) -> KVBudget | None:
        """The figure a new member of the group ``engine_ids`` should use, or None.

        The registry's figure (the smallest ever published for this model and device),
        lowered to the smallest ``kv_cache_bytes`` that a live member of the group
        reports in its engine record, if one runs with less (it published during an
        etcd outage, or was started with a lower memory limit). Group members that
        report no figure (0) are ignored. None when nothing was published: profile.
        """
        budget = self.lookup(model_fingerprint, device_kind)
        if budget is None:
            return None
        records = self._engine_records(engine_ids)
        known = [r for r in records if r.kv_cache_bytes > 0]
        if not known:
            return budget
        smallest = min(known, key=lambda r: r.kv_cache_bytes)
        if smallest.kv_cache_bytes >= budget.kv_cache_bytes:
            return budget
        bytes_per_block = max(budget.kv_cache_bytes // budget.num_blocks, 1)
        return KVBudget(kv_cache_bytes=smallest.kv_cache_bytes, block_size=budget.block_size,
                        num_blocks=smallest.kv_cache_bytes // bytes_per_block,
                        engine_id=smallest.engine_id, recorded_at=self._clock())

    def _engine_records(self, engine_ids: Iterable[str]) -> list[EngineRecord]:
        out = []
        for engine_id in engine_ids:
            key = self.layout.engine(engine_id)
            with etcd_call(f"read {key}"):
                value, _meta = self._client.get(key)
            if value is not None:
                out.append(decode(key, value, EngineRecord))
        return out
