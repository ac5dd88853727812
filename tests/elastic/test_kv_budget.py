"""The KV-budget registry: smallest figure wins, concurrently too."""

from __future__ import annotations

import threading

import pytest

from planaria.elastic.keys import EngineRecord, KVBudget, KeyLayout, encode
from planaria.elastic.kv_budget import KVBudgetRegistry

FP, DEV = "sha256-abc123", "NVIDIA H200"
BLOCK_BYTES = 1 << 20


def budget(num_blocks: int, engine_id: str) -> KVBudget:
    return KVBudget(kv_cache_bytes=num_blocks * BLOCK_BYTES, block_size=16,
                    num_blocks=num_blocks, engine_id=engine_id, recorded_at=1.0)


def test_publish_first_then_smallest_wins(client, cluster):
    reg = KVBudgetRegistry(client, cluster)
    assert reg.lookup(FP, DEV) is None
    assert reg.publish(FP, DEV, budget(100, "e0")).engine_id == "e0"
    assert reg.publish(FP, DEV, budget(120, "e1")).engine_id == "e0"   # larger: kept e0
    assert reg.publish(FP, DEV, budget(90, "e2")).engine_id == "e2"    # smaller: replaces
    assert reg.publish(FP, DEV, budget(90, "e3")).engine_id == "e2"    # tie: first stays
    assert reg.lookup(FP, DEV) == budget(90, "e2")
    assert reg.lookup(FP, "cpu") is None                               # per device kind
    assert reg.lookup("other-model", DEV) is None


def test_concurrent_publishers_keep_the_minimum(client, cluster):
    reg = KVBudgetRegistry(client, cluster, max_attempts=64)
    sizes = [130, 110, 150, 95, 120, 101, 140, 97]
    barrier = threading.Barrier(len(sizes))

    def publish(i: int) -> None:
        barrier.wait()
        reg.publish(FP, DEV, budget(sizes[i], f"e{i}"))

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(len(sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert reg.lookup(FP, DEV).num_blocks == min(sizes)


def test_publish_rejects_nonpositive(client, cluster):
    with pytest.raises(ValueError):
        KVBudgetRegistry(client, cluster).publish(FP, DEV, budget(0, "e0"))


def test_smallest_for_group(client, cluster):
    reg = KVBudgetRegistry(client, cluster, clock=lambda: 7.0)
    layout = KeyLayout(cluster)
    assert reg.smallest_for_group(FP, DEV, ["e0"]) is None        # nothing published
    reg.publish(FP, DEV, budget(100, "e0"))
    for engine_id, num_blocks in (("e0", 100), ("e1", 0)):
        client.put(layout.engine(engine_id), encode(EngineRecord(
            engine_id=engine_id, node_id="n1", kv_cache_bytes=num_blocks * BLOCK_BYTES)))
    # Group members run with the registry's figure (or report none): take the registry's.
    assert reg.smallest_for_group(FP, DEV, ["e0", "e1", "missing"]) == budget(100, "e0")
    # A member runs with less than the registry says: the newcomer matches it.
    client.put(layout.engine("e2"), encode(EngineRecord(
        engine_id="e2", node_id="n2", kv_cache_bytes=80 * BLOCK_BYTES + 5)))
    got = reg.smallest_for_group(FP, DEV, ["e0", "e2"])
    assert (got.kv_cache_bytes, got.num_blocks, got.block_size, got.engine_id, got.recorded_at) \
        == (80 * BLOCK_BYTES + 5, 80, 16, "e2", 7.0)
    assert reg.smallest_for_group(FP, DEV, ["e0"]) == budget(100, "e0")
