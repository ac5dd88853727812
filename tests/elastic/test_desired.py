"""``desired`` and ``ops/``: the newest scale request wins and supersedes the op in
progress; finished ops are kept up to a bound."""

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


def test_a_request_supersedes_the_op_in_progress(client, cluster):
    store = DesiredStore(client, cluster)
    store.request_scale(3, "op-1")
    store.update_op("op-1", phase=OpPhase.SWITCHING, progress="2/3 ranks switched")
    assert store.request_scale(4, "op-2").num_engines == 4
    old = store.get_op("op-1")
    assert old.phase is OpPhase.CANCELLED and old.error == "superseded by op-2 (scale to 4)"
    assert store.active_op().op_id == "op-2" and store.read_desired()[0].op_id == "op-2"
    with pytest.raises(ValueError):  # a superseded op is final: the leader cannot revive it
        store.update_op("op-1", phase=OpPhase.DONE)
    with pytest.raises(ScaleConflictError):  # an op id is never reused
        store.request_scale(5, "op-1")


def test_concurrent_scale_requests_leave_one_op_in_progress_and_it_is_desireds(client, cluster):
    store = DesiredStore(client, cluster)
    barrier = threading.Barrier(5)
    outcomes: list[str] = []

    def request(i: int) -> None:
        barrier.wait()
        try:
            store.request_scale(i + 1, f"op-{i}")
            outcomes.append("ok")
        except ScaleConflictError:
            outcomes.append("conflict")  # only if desired kept changing for every attempt

    threads = [threading.Thread(target=request, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(outcomes) == 5 and "ok" in outcomes
    active = [op for op in store.list_ops() if not op.phase.is_final]
    assert len(active) == 1 and active[0].op_id == store.read_desired()[0].op_id
    assert all(op.phase is OpPhase.CANCELLED and "superseded" in op.error
               for op in store.list_ops() if op is not active[0] and op.op_id != active[0].op_id)


def test_finished_ops_are_kept_up_to_a_bound(client, cluster):
    from planaria.elastic.desired import MAX_KEPT_OPS

    store = DesiredStore(client, cluster)
    for i in range(MAX_KEPT_OPS + 5):
        store.request_scale(2 + i % 2, f"op-{i:03d}")
    ops = store.list_ops()
    assert len(ops) == MAX_KEPT_OPS + 1  # the kept finished ones and the one in progress
    assert store.get_op("op-000") is None and store.get_op(f"op-{MAX_KEPT_OPS + 4:03d}").phase is OpPhase.PENDING


def test_a_hostile_op_record_does_not_block_requests(client, cluster):
    store = DesiredStore(client, cluster)
    client.put(store.layout.op("evil"), b"[" * 10000)
    assert store.request_scale(3, "op-1").num_engines == 3


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
