"""The short version of bench/mttr.py in the suite: each fault class once on tiny-moe
(replica and expert-parallel `planaria serve` under a streaming load). Every request ends
with the fault-free text, none fails, every stream moves again within a bound loose
enough for a loaded 2-core CI machine; the full table is bench/mttr.py's."""

from __future__ import annotations

import pytest

from bench import mttr

pytestmark = pytest.mark.timeout(900)
STALL_BOUND_S = 5.0  # CI; the table of record (docs/operations.md) is under 1 s per class


def test_every_fault_class_recovers_with_no_failed_request_and_the_fault_free_text(tiny_moe):
    args = mttr.parse_args(["--model", tiny_moe, "--reps", "1", "--streams", "3", "--max-tokens", "24,48",
                            "--threads", "1", "--engine-config-json",
                            '{"max_model_len": 256, "max_num_seqs": 16, "kv_cache_bytes": 16777216}'])
    runs = mttr.measure(args, lambda line: None)
    print("\n".join(mttr.table(runs)))
    assert {r.fault for r in runs} == set(mttr.ALL_CLASSES)
    for r in runs:
        assert r.failed == 0 and r.differing == 0, r
        assert r.whole_s is not None, r  # whole again
        assert r.service_s is None or r.service_s < STALL_BOUND_S, r
    poison = next(r for r in runs if r.fault == "poison")
    assert "quarantined" in poison.detail["poison"]["body"], poison
