"""Planner tables: pure logic, no etcd."""

from __future__ import annotations

import pytest

from planaria.elastic.keys import EngineRecord, EngineRecordState, Epoch
from planaria.elastic.planner import (Abort, ExpertMove, NoChange, Rebalance, Reform, ScaleDown, ScaleUp, engine_moves,
                             expert_map, moves, plan_abort, plan_epoch)

NOW = 1000.0


def epoch(number: int, ranks: list[str], num_experts: int = 8) -> Epoch:
    return Epoch(number=number, world_size=len(ranks), ranks=ranks,
                 expert_map=expert_map(num_experts, len(ranks)) if ranks else [],
                 created_at=0.0)


@pytest.mark.parametrize("num_experts, world_size, expected", [
    (8, 1, [0] * 8),
    (8, 2, [0, 0, 0, 0, 1, 1, 1, 1]),
    (10, 3, [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]),
    (4, 4, [0, 1, 2, 3]),
    (3, 4, [0, 1, 2]),          # more ranks than experts: the last rank holds none
    (0, 2, []),
    (0, 0, []),
])
def test_expert_map(num_experts, world_size, expected):
    got = expert_map(num_experts, world_size)
    assert got == expected
    if world_size:
        counts = [got.count(r) for r in range(world_size)]
        assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("num_experts, world_size", [(-1, 1), (4, 0), (4, -2)])
def test_expert_map_rejects(num_experts, world_size):
    with pytest.raises(ValueError):
        expert_map(num_experts, world_size)


@pytest.mark.parametrize("old_ws, new_ws, expected", [
    (2, 2, []),
    (1, 2, [ExpertMove(4, 0, 1), ExpertMove(5, 0, 1), ExpertMove(6, 0, 1),
            ExpertMove(7, 0, 1)]),
    (2, 1, [ExpertMove(4, 1, 0), ExpertMove(5, 1, 0), ExpertMove(6, 1, 0),
            ExpertMove(7, 1, 0)]),
    (2, 4, [ExpertMove(2, 0, 1), ExpertMove(3, 0, 1), ExpertMove(4, 1, 2),
            ExpertMove(5, 1, 2), ExpertMove(6, 1, 3), ExpertMove(7, 1, 3)]),
])
def test_moves(old_ws, new_ws, expected):
    assert moves(expert_map(8, old_ws), expert_map(8, new_ws)) == expected


def test_moves_rejects_different_models():
    with pytest.raises(ValueError):
        moves([0, 0], [0, 0, 0])


def test_engine_moves_after_reform_names_no_source_for_dead_holder():
    old = epoch(3, ["a", "b", "c"], num_experts=6)      # a:0,1 b:2,3 c:4,5
    new = epoch(4, ["a", "c"], num_experts=6)           # a:0,1,2 c:3,4,5
    assert engine_moves(old, new) == [(2, None, "a"), (3, None, "c")]


# (name, current ranks or None, desired, live, expected type, expected new ranks, detail)
CASES = [
    ("bootstrap", None, 2, ["a", "b"], ScaleUp, ["a", "b"], ["a", "b"]),
    ("bootstrap with fewer live", None, 3, ["a"], ScaleUp, ["a"], ["a"]),
    ("bootstrap extra live ignored", None, 1, ["a", "b"], ScaleUp, ["a"], ["a"]),
    ("bootstrap none live", None, 2, [], NoChange, None, None),
    ("bootstrap desired 0", None, 0, ["a"], NoChange, None, None),
    ("steady", ["a", "b"], 2, ["a", "b"], NoChange, None, None),
    ("steady, spare live", ["a", "b"], 2, ["a", "b", "c"], NoChange, None, None),
    ("scale up", ["a", "b"], 3, ["a", "b", "c"], ScaleUp, ["a", "b", "c"], ["c"]),
    ("scale up two", ["a"], 3, ["c", "a", "b"], ScaleUp, ["a", "c", "b"], ["c", "b"]),
    ("scale up waits for all", ["a"], 3, ["a", "b"], NoChange, None, None),
    ("scale down", ["a", "b", "c"], 1, ["a", "b", "c"], ScaleDown, ["a"], ["b", "c"]),
    ("scale to zero", ["a", "b"], 0, ["a", "b"], ScaleDown, [], ["a", "b"]),
    ("dead rank", ["a", "b", "c"], 3, ["a", "c"], Reform, ["a", "c"], ["b"]),
    ("dead rank beats scale up", ["a", "b"], 4, ["a", "c", "d"], Reform, ["a"], ["b"]),
    ("all dead", ["a", "b"], 2, [], Reform, [], ["a", "b"]),
    ("empty epoch rebuilt", [], 2, ["x", "y"], ScaleUp, ["x", "y"], ["x", "y"]),
    ("duplicate live ids", None, 3, ["a", "a", "b"], ScaleUp, ["a", "b"], ["a", "b"]),
]


@pytest.mark.parametrize("name, ranks, desired, live, kind, new_ranks, detail",
                         CASES, ids=[c[0] for c in CASES])
def test_plan_epoch(name, ranks, desired, live, kind, new_ranks, detail):
    current = epoch(5, ranks) if ranks is not None else None
    action = plan_epoch(current, desired, live, num_experts=8, now=NOW,
                        rendezvous="127.0.0.1:1", leader="n1")
    assert type(action) is kind
    if kind is NoChange:
        assert action.reason
        return
    new = action.epoch
    assert new.ranks == new_ranks
    assert new.world_size == len(new_ranks)
    assert new.number == (current.number + 1 if current else 1)
    assert new.expert_map == (expert_map(8, len(new_ranks)) if new_ranks else [])
    assert (new.created_at, new.rendezvous, new.leader) == (NOW, "127.0.0.1:1", "n1")
    got_detail = {ScaleUp: "joining", ScaleDown: "departing", Reform: "dead"}[kind]
    assert getattr(action, got_detail) == detail


def test_existing_ranks_keep_their_index_on_scale_up_and_down():
    up = plan_epoch(epoch(1, ["a", "b"]), 4, ["a", "b", "c", "d"], 8, NOW)
    assert up.epoch.ranks[:2] == ["a", "b"]
    down = plan_epoch(up.epoch, 2, ["a", "b", "c", "d"], 8, NOW)
    assert isinstance(down, ScaleDown) and down.epoch.ranks == ["a", "b"]


def test_plan_rejects_negative_desired():
    with pytest.raises(ValueError):
        plan_epoch(None, -1, ["a"], 8, NOW)


# -- aborting a failed switch ------------------------------------------------------------------
S, R, U = EngineRecordState.SERVING, EngineRecordState.READY, EngineRecordState.UNHEALTHY


def rec(eid: str, state: EngineRecordState, epoch_no: int = 0, served: int = 0, failed: int = 0,
        error: str = "") -> EngineRecord:
    return EngineRecord(engine_id=eid, node_id="n", state=state, epoch=epoch_no, served_epoch=served,
                        failed_epoch=failed, error=error)


def recs(*records: EngineRecord) -> dict[str, EngineRecord]:
    return {r.engine_id: r for r in records}


SWITCH = Epoch(number=5, world_size=3, ranks=["a", "b", "c"], expert_map=expert_map(8, 3), created_at=NOW)
OLD_SERVING = (rec("a", S, 4, served=4), rec("b", S, 4, served=4))


@pytest.mark.parametrize("records, now, expected", [
    # served by every rank: nothing to judge
    (recs(rec("a", S, 5, 5), rec("b", S, 5, 5), rec("c", S, 5, 5)), NOW + 99, None),
    # joiner c not there yet, within the timeout: wait (the old group goes on serving)
    (recs(*OLD_SERVING, rec("c", R)), NOW + 5, None),
    # ... past the timeout: back to the old membership, c left out
    (recs(*OLD_SERVING, rec("c", R)), NOW + 11, (["a", "b"], ["c"], "within 10 s")),
    # a rank reported the failure: abort at once; reporters and old ranks stay, silent c goes
    (recs(rec("a", U, served=4, failed=5, error="CollectiveError: timed out"),
          rec("b", U, served=4, failed=5, error="CollectiveError: timed out"), rec("c", R)),
     NOW + 1, (["a", "b"], ["c"], "a: CollectiveError: timed out")),
    # a joiner that reported is alive and answering: it stays (a retry of the same set)
    (recs(rec("a", U, served=4, failed=5), rec("b", U, served=4, failed=5), rec("c", R, failed=5)),
     NOW + 1, (["a", "b", "c"], [], "3 rank(s) failed")),
    # an old failure report (epoch 4) is not about this switch
    (recs(*OLD_SERVING, rec("c", R, failed=4)), NOW + 1, None),
    # a rank with no record (gone) is left out
    (recs(rec("a", U, served=4, failed=5), rec("c", R)), NOW + 1, (["a"], ["b", "c"], "left out: b, c")),
    # nobody healthy (no rank ever served, none reported): nothing to re-form with
    (recs(rec("a", R), rec("b", R), rec("c", R)), NOW + 60, None),
])
def test_plan_abort(records, now, expected):
    got = plan_abort(SWITCH, records, 8, now, switch_timeout_s=10.0, rendezvous="h:1", leader="L")
    if expected is None:
        assert got is None
        return
    ranks, excluded, reason = expected
    assert isinstance(got, Abort)
    assert got.failed == 5 and got.epoch.number == 6 and got.epoch.ranks == ranks
    assert got.epoch.expert_map == expert_map(8, len(ranks)) and got.epoch.world_size == len(ranks)
    assert (got.epoch.rendezvous, got.epoch.leader, got.epoch.created_at) == ("h:1", "L", now)
    assert got.excluded == excluded and reason in got.reason


def test_plan_abort_no_epoch():
    assert plan_abort(None, {}, 8, NOW, 10.0) is None


# -- under a placement (allowed: the engines it keeps) -------------------------------------------
# (name, current ranks or None, desired, live, allowed, expected type, new ranks, joining, departing)
PLACED = [
    ("bootstrap, only the placed", None, 2, ["a0", "a1", "b0"], {"a0", "b0"}, ScaleUp, ["a0", "b0"], ["a0", "b0"], []),
    ("scale up on another node", ["a0", "b0"], 3, ["a0", "b0", "a1"], {"a0", "b0", "a1"}, ScaleUp,
     ["a0", "b0", "a1"], ["a1"], []),
    ("an unplaced live engine never joins", ["a0"], 2, ["a0", "a1"], {"a0", "b0"}, NoChange, None, None, None),
    ("scale down: the unplaced rank departs, not the highest", ["a0", "a1", "b0"], 2, ["a0", "a1", "b0"],
     {"a0", "b0"}, ScaleDown, ["a0", "b0"], [], ["a1"]),
    ("moved to another node: one switch, once the joiner is live", ["a0", "a1"], 2, ["a0", "a1", "b0"],
     {"a0", "b0"}, Rebalance, ["a0", "b0"], ["b0"], ["a1"]),
    ("moved, joiner not live yet: the old rank serves meanwhile", ["a0", "a1"], 2, ["a0", "a1"],
     {"a0", "b0"}, NoChange, None, None, None),
    ("placed and sized", ["a0", "b0"], 2, ["a0", "b0", "a1"], {"a0", "b0"}, NoChange, None, None, None),
    ("a dead rank still re-forms first", ["a0", "b0"], 2, ["a0"], {"a0", "b0"}, Reform, ["a0"], None, None),
]


@pytest.mark.parametrize("name, ranks, desired, live, allowed, kind, new_ranks, joining, departing",
                         PLACED, ids=[c[0] for c in PLACED])
def test_plan_epoch_under_a_placement(name, ranks, desired, live, allowed, kind, new_ranks, joining, departing):
    current = epoch(5, ranks) if ranks is not None else None
    action = plan_epoch(current, desired, live, num_experts=8, now=NOW, allowed=allowed)
    assert type(action) is kind, action
    if kind is NoChange:
        assert action.reason
        return
    assert action.epoch.ranks == new_ranks and action.epoch.world_size == len(new_ranks)
    assert action.epoch.expert_map == expert_map(8, len(new_ranks))
    if kind is not Reform:
        assert getattr(action, "joining", []) == joining and getattr(action, "departing", []) == departing
