"""Placement of the cluster's engines over the nodes: pure tables, then the fenced key on a
real etcd."""

from __future__ import annotations

import pytest

from planaria.elastic.errors import PlacementConflictError, StaleLeaderError
from planaria.elastic.keys import EngineRecord, EngineRecordState, NodeInfo
from planaria.elastic.placement import Placement, PlacementStore, allowed_engines, capacity, default_target, place


def node(nid: str, engines: int = 1, max_engines: int = 3, started_at: float = 0.0) -> NodeInfo:
    return NodeInfo(node_id=nid, host="10.0.0.1", capacity={"engines": engines, "max_engines": max_engines},
                    started_at=started_at)


A, B, C = node("a", started_at=1.0), node("b", started_at=2.0), node("c", started_at=3.0)


# (name, target, nodes, previous, expected shares, unplaced)
CASES = [
    ("first: each node's --engines", 2, [A, B], None, {"a": 1, "b": 1}, 0),
    ("scale up: the fewest, the oldest on a tie", 3, [A, B], {"a": 1, "b": 1}, {"a": 2, "b": 1}, 0),
    ("scale up again: the fewest", 4, [A, B], {"a": 2, "b": 1}, {"a": 2, "b": 2}, 0),
    ("scale down: the most loaded", 2, [A, B], {"a": 2, "b": 1}, {"a": 1, "b": 1}, 0),
    ("scale down on a tie: the newest node", 1, [A, B], {"a": 1, "b": 1}, {"a": 1, "b": 0}, 0),
    ("existing engines are kept: a spare node joins", 3, [A, B, node("c", 0, started_at=3.0)], {"a": 2, "b": 1},
     {"a": 2, "b": 1, "c": 0}, 0),
    ("a new node brings its --engines, the most loaded gives", 3, [A, B, C], {"a": 3}, {"a": 1, "b": 1, "c": 1}, 0),
    ("a gone node's share moves", 2, [A], {"a": 1, "b": 1}, {"a": 2}, 0),
    ("capacity is a cap", 8, [A, B], {"a": 1, "b": 1}, {"a": 3, "b": 3}, 2),
    ("a previous share above a lowered capacity", 3, [node("a", max_engines=1, started_at=1.0), B],
     {"a": 3, "b": 0}, {"a": 1, "b": 2}, 0),
    ("no nodes", 2, [], None, {}, 2),
    ("zero", 0, [A, B], {"a": 1, "b": 1}, {"a": 0, "b": 0}, 0),
]


@pytest.mark.parametrize("name, target, nodes, previous, shares, unplaced", CASES, ids=[c[0] for c in CASES])
def test_place(name, target, nodes, previous, shares, unplaced):
    got, left = place(target, nodes, previous)
    assert got == shares and left == unplaced
    assert sum(got.values()) + left == target


def test_targets_from_the_nodes():
    assert default_target([node("a", 2), node("b", 1)]) == 3
    assert default_target([node("a", 5, max_engines=2)]) == 2
    assert capacity([node("a", max_engines=4), node("b", max_engines=2)]) == 6
    with pytest.raises(ValueError):
        place(-1, [A], None)


def rec(eid: str, nid: str, index: int, state=EngineRecordState.SERVING) -> EngineRecord:
    return EngineRecord(engine_id=eid, node_id=nid, state=state, addresses={"engine_index": str(index)})


def test_allowed_engines_are_each_nodes_lowest_numbered():
    records = [rec("a-e1", "a", 1), rec("a-e0", "a", 0), rec("a-e2", "a", 2), rec("b-e0", "b", 0),
               rec("b-e1", "b", 1, EngineRecordState.STOPPED), rec("c-e0", "c", 0)]
    assert allowed_engines({"a": 2, "b": 2}, records) == {"a-e0", "a-e1", "b-e0"}  # c: not placed
    assert allowed_engines({"a": 0, "b": 1, "c": 1}, records) == {"b-e0", "c-e0"}
    # a restart: e0's record is gone for a moment, so e1 is the one kept meanwhile
    assert allowed_engines({"a": 1}, [rec("a-e1", "a", 1)]) == {"a-e1"}


def test_placement_key_is_fenced_by_the_leader_and_its_revision(client, cluster, make_membership):
    from planaria.elastic.election import LeaderElection
    from tests.elastic.conftest import wait_for

    store = PlacementStore(client, cluster)
    assert store.read() == (None, 0)
    election = LeaderElection(make_membership("n1"))
    election.start()
    try:
        assert wait_for(lambda: election.is_leader, 10)
        token = election.leader_revision
        first = Placement(engines={"n1": 2}, target=2, leader="n1")
        store.write(first, 0, token)
        got, rev = store.read()
        assert got == first and rev > 0
        with pytest.raises(PlacementConflictError):
            store.write(Placement(engines={"n1": 3}, target=3), 0, token)  # read before the write
        with pytest.raises(StaleLeaderError):
            store.write(Placement(engines={"n1": 3}, target=3), rev, token + 1000)  # not the leader's term
        store.write(Placement(engines={"n1": 3}, target=3), rev, token)
        assert store.read()[0].engines == {"n1": 3}
    finally:
        election.stop()
