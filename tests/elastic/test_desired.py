"""``desired`` and ``ops/``: scale requests refuse while an op is in progress."""

from __future__ import annotations

import threading

import pytest

from planaria.elastic.desired import DesiredStore, OpNotFoundError
from planaria.elastic.election import LeaderElection
from planaria.elastic.errors import ScaleConflictError, StaleLeaderError
from planaria.elastic.keys import NodeInfo, OpPhase


def test_request_scale_writes_desired_and_pending_op(client, cluster):
    store = DesiredStore(client, cluster, clock=lambda: 5.0)
    assert store.read_desired() == (None, 0)
    desired = store.request_scale(3, "op-1")
    assert (desired.num_engines, desired.op_id, desired.requested_at) == (3, "op-1", 5.0)
    got, rev = store.read_desired()
    assert got == desired and rev > 0
    op = store.get_op("op-1")
    assert (op.phase, op.target, op.kind) == (OpPhase.PENDING, 3, "scale")
    assert store.get_op("nope") is None


def test_request_scale_refused_while_op_in_progress(client, cluster):
    store = DesiredStore(client, cluster)
    store.request_scale(3, "op-1")
    with pytest.raises(ScaleConflictError) as info:
        store.request_scale(4, "op-2")
    assert info.value.op_id == "op-1"
    store.update_op("op-1", phase=OpPhase.SWITCHING, progress="2/3 ranks switched")
    with pytest.raises(ScaleConflictError):
        store.request_scale(4, "op-2")
    store.update_op("op-1", phase=OpPhase.DONE)
    assert store.request_scale(4, "op-2").num_engines == 4
    assert store.read_desired()[0].op_id == "op-2"


def test_concurrent_scale_requests_one_wins(client, cluster):
    store = DesiredStore(client, cluster)
    barrier = threading.Barrier(5)
    outcomes: list[str] = []

    def request(i: int) -> None:
        barrier.wait()
        try:
            store.request_scale(i + 1, f"op-{i}")
            outcomes.append("ok")
        except ScaleConflictError:
            outcomes.append("conflict")

    threads = [threading.Thread(target=request, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(outcomes) == ["conflict"] * 4 + ["ok"]
    assert len([op for op in store.list_ops() if not op.phase.is_final]) == 1


def test_update_op_fields_and_final_phase(client, cluster):
    store = DesiredStore(client, cluster, clock=lambda: 9.0)
    store.request_scale(2, "op-1")
    op = store.update_op("op-1", phase=OpPhase.LAUNCHING, progress="1/2 loaded",
                         kind="scale_up")
    assert (op.phase, op.progress, op.kind, op.target, op.updated_at) == \
        (OpPhase.LAUNCHING, "1/2 loaded", "scale_up", 2, 9.0)
    assert store.get_op("op-1") == op
    store.update_op("op-1", phase=OpPhase.FAILED, error="engine e3 died while loading")
    assert store.get_op("op-1").error == "engine e3 died while loading"
    with pytest.raises(ValueError):
        store.update_op("op-1", phase=OpPhase.RESUMING)
    with pytest.raises(OpNotFoundError):
        store.update_op("missing", phase=OpPhase.DONE)
    with pytest.raises(ScaleConflictError):
        store.request_scale(3, "op-1")             # op ids are not reused


def test_update_op_fenced_by_leader_token(make_membership, client, cluster):
    a, b = make_membership("a"), make_membership("b")
    ea, eb = LeaderElection(a), LeaderElection(b)
    assert ea.campaign()
    token = ea.leader_revision
    store = DesiredStore(client, cluster)
    store.request_scale(2, "op-1")
    store.update_op("op-1", phase=OpPhase.LAUNCHING, leader_create_revision=token)
    client.revoke_lease(a.lease_id)
    assert eb.campaign()
    with pytest.raises(StaleLeaderError):
        store.update_op("op-1", phase=OpPhase.DONE, leader_create_revision=token)
    assert store.get_op("op-1").phase is OpPhase.LAUNCHING


@pytest.mark.parametrize("place_engines", [False, True])
def test_a_request_landing_mid_tick_is_not_marked_done_at_the_old_size(leader, place_engines):
    """A scale request that lands between the leader's reads of ``desired`` and ``ops/``
    pairs, read in that order, the new op with the old size, and the op was marked DONE at
    the size the cluster already had (`planaria scale to 3 --wait` then ended at once with 2
    of 2 serving; seen in CI right after an etcd restart)."""
    c, _client, _layout, _store = leader
    if place_engines:  # `planaria serve --parallel ep`: the leader places over the node records
        c.place_engines = True
        c.membership.register_node(NodeInfo(node_id="n", host="127.0.0.1", capacity={"engines": 2, "max_engines": 3},
                                            addresses={"rendezvous": "127.0.0.1:29500"}))
    c.tick()  # settle: the placement (place_engines) is written at the current size
    reads = []
    read_desired = c.desired.read_desired

    def read_then_request():
        got = read_desired()
        if not reads:
            reads.append(got)
            c.desired.request_scale(3, "op-mid")  # lands right after this read
        return got

    c.desired.read_desired = read_then_request
    c.tick()
    assert c.desired.get_op("op-mid").phase == OpPhase.PENDING  # not DONE at 2 ranks
    c.tick()
    op = c.desired.get_op("op-mid")
    assert not op.phase.is_final, op  # acted on at the new size
    if place_engines:
        assert op.phase == OpPhase.LAUNCHING and "n: 3" in op.progress, op
