"""Leader election and epoch fencing against a real etcd."""

from __future__ import annotations

import threading
import time

import pytest

from planaria.elastic.election import LeaderElection
from planaria.elastic.epochs import EpochStore
from planaria.elastic.errors import EpochConflictError, EtcdUnavailableError, StaleLeaderError
from planaria.elastic.keys import Epoch
from planaria.elastic.membership import Membership
from planaria.elastic.planner import expert_map
from tests.elastic.conftest import TTL_S, wait_for


def make_epoch(number: int, ranks: list[str], leader: str) -> Epoch:
    return Epoch(number=number, world_size=len(ranks), ranks=ranks,
                 expert_map=expert_map(8, len(ranks)), rendezvous="127.0.0.1:1",
                 leader=leader, created_at=time.time())


def test_racing_electors_exactly_one_leader(make_membership):
    members = [make_membership(f"n{i}") for i in range(6)]
    elections = [LeaderElection(m) for m in members]
    barrier = threading.Barrier(len(elections))
    results: dict[int, bool] = {}

    def race(i: int) -> None:
        barrier.wait()
        results[i] = elections[i].campaign()

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(elections))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results.values()) == [False] * 5 + [True]
    winner = next(i for i, won in results.items() if won)
    assert [e.is_leader for e in elections].count(True) == 1
    node_id, revision = elections[0].current_leader()
    assert node_id == f"n{winner}"
    assert elections[winner].leader_revision == revision
    # Campaigning again is idempotent for the winner and still fails for the rest.
    assert elections[winner].campaign() is True
    assert elections[winner].leader_revision == revision
    assert elections[(winner + 1) % 6].campaign() is False


def test_background_loop_takes_over_when_leader_dies(make_membership):
    a, b = make_membership("a"), make_membership("b")
    changes: list[tuple[str, bool]] = []
    ea = LeaderElection(a, on_change=lambda up: changes.append(("a", up))).start()
    assert wait_for(lambda: ea.is_leader, timeout_s=3)
    eb = LeaderElection(b, on_change=lambda up: changes.append(("b", up))).start()
    try:
        assert eb.campaign() is False and not eb.is_leader  # b tries, and a's key holds
        a_token = ea.leader_revision
        died_at = time.monotonic()
        ea.stop(resign=False)
        a.close(revoke=False)            # crash: key lives until a's lease expires
        assert wait_for(lambda: eb.is_leader, timeout_s=TTL_S + 3)
        assert time.monotonic() - died_at < TTL_S + 3
        assert eb.leader_revision > a_token
        assert ("a", True) in changes and ("b", True) in changes
    finally:
        eb.stop()


def test_resign_hands_over_quickly(make_membership):
    a, b = make_membership("a"), make_membership("b")
    ea = LeaderElection(a)
    assert ea.campaign()
    eb = LeaderElection(b).start()
    try:
        ea.resign()
        assert not ea.is_leader
        assert wait_for(lambda: eb.is_leader, timeout_s=2)   # watch-driven, not TTL-driven
    finally:
        eb.stop()


def test_stale_leader_is_fenced(make_membership, client, cluster):
    a, b = make_membership("a"), make_membership("b")
    ea, eb = LeaderElection(a), LeaderElection(b)
    store_a, store_b = EpochStore(a.client, cluster), EpochStore(b.client, cluster)
    assert ea.campaign()
    a_token = ea.leader_revision
    first, rev = store_a.read_epoch()
    assert first is None and rev == 0
    rev1 = store_a.write_epoch(make_epoch(1, ["e0"], "a"), 0, a_token)
    # A decides on epoch 2 from what it read, then loses its lease before writing.
    _epoch, read_rev = store_a.read_epoch()
    assert read_rev == rev1
    client.revoke_lease(a.lease_id)
    assert eb.campaign()
    b_token = eb.leader_revision
    assert b_token > a_token
    rev2 = store_b.write_epoch(make_epoch(2, ["e0", "e1"], "b"), rev1, b_token)
    with pytest.raises(StaleLeaderError) as info:
        store_a.write_epoch(make_epoch(2, ["e0"], "a"), read_rev, a_token)
    assert info.value.current_leader == "b"
    assert info.value.current_revision == b_token
    # Even with the right mod revision A is refused: the leader check is in the txn.
    with pytest.raises(StaleLeaderError):
        store_a.write_epoch(make_epoch(3, ["e0"], "a"), rev2, a_token)
    epoch, rev = store_b.read_epoch()
    assert (epoch.number, epoch.leader, rev) == (2, "b", rev2)
    # A noticed: the lease listener dropped its leadership.
    assert wait_for(lambda: not ea.is_leader, timeout_s=TTL_S)


def test_write_epoch_without_any_leader_is_stale(client, cluster):
    store = EpochStore(client, cluster)
    with pytest.raises(StaleLeaderError) as info:
        store.write_epoch(make_epoch(1, ["e0"], "x"), 0, 12345)
    assert info.value.current_leader is None
    assert store.read_epoch() == (None, 0)


def test_epoch_cas_conflicts(make_membership, cluster):
    a = make_membership("a")
    ea = LeaderElection(a)
    assert ea.campaign()
    token = ea.leader_revision
    store = EpochStore(a.client, cluster)
    rev1 = store.write_epoch(make_epoch(1, ["e0"], "a"), 0, token)
    with pytest.raises(EpochConflictError) as info:     # "first" write, but one exists
        store.write_epoch(make_epoch(1, ["e9"], "a"), 0, token)
    assert info.value.actual_mod_revision == rev1
    rev2 = store.write_epoch(make_epoch(2, ["e0", "e1"], "a"), rev1, token)
    assert rev2 > rev1
    with pytest.raises(EpochConflictError):             # stale read
        store.write_epoch(make_epoch(3, ["e0"], "a"), rev1, token)
    # Two writers from the same read: exactly one wins.
    outcomes = []

    def write(ranks: list[str]) -> None:
        try:
            store.write_epoch(make_epoch(3, ranks, "a"), rev2, token)
            outcomes.append("ok")
        except EpochConflictError:
            outcomes.append("conflict")

    threads = [threading.Thread(target=write, args=([f"e{i}"],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(outcomes) == ["conflict"] * 3 + ["ok"]
    assert store.read_epoch()[0].number == 3


def test_leader_loses_leadership_when_etcd_down_past_ttl(private_etcd, cluster):
    m = Membership.from_endpoints(private_etcd.endpoint, cluster, "a", ttl_s=TTL_S).start()
    e = LeaderElection(m).start()
    try:
        assert wait_for(lambda: e.is_leader, timeout_s=3)
        private_etcd.kill()
        with pytest.raises(EtcdUnavailableError):
            e.campaign()
        # It cannot know whether its lease still exists: it must stop calling itself leader.
        assert wait_for(lambda: not e.is_leader, timeout_s=TTL_S + 1)
        private_etcd.start()
        assert wait_for(lambda: e.is_leader, timeout_s=TTL_S + 3)
        store = EpochStore(m.client, cluster)
        store.write_epoch(make_epoch(1, ["e0"], "a"), 0, e.leader_revision)
    finally:
        e.stop()
        m.close(revoke=False)


_ELECTOR = """
import sys, time
from planaria.elastic.election import LeaderElection
from planaria.elastic.membership import Membership
endpoint, cluster, node_id, start_at = sys.argv[1:5]
m = Membership.from_endpoints(endpoint, cluster, node_id, ttl_s=5).start()
m.ensure_lease()
e = LeaderElection(m)
time.sleep(max(0.0, float(start_at) - time.time()))
won = e.campaign()
print("RESULT", "won" if won else "lost", e.leader_revision, flush=True)
sys.stdin.read()          # hold the lease until the test closes stdin
m.close()
"""


def _result_line(proc) -> list[str]:
    """The child's ``RESULT won|lost <token>`` line, skipping its log lines."""
    for line in proc.stdout:
        if line.startswith("RESULT "):
            return line.split()[1:]
    raise AssertionError(f"elector exited with {proc.wait()} without a result")


def test_racing_processes_exactly_one_leader(etcd_server, client, cluster):
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    start_at = time.time() + 3.0
    procs = [subprocess.Popen(
        [sys.executable, "-c", _ELECTOR, etcd_server.endpoint, cluster, f"p{i}", str(start_at)],
        cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True) for i in range(3)]
    try:
        lines = [_result_line(p) for p in procs]
        assert sorted(line[0] for line in lines) == ["lost", "lost", "won"]
        winner = next(i for i, line in enumerate(lines) if line[0] == "won")
        value, meta = client.get(f"/planaria/{cluster}/leader")
        assert value.decode() == f"p{winner}"
        assert int(lines[winner][1]) == meta.create_revision
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_campaign_on_an_expired_lease_regrants_instead_of_crashing(etcd_server, client, cluster):
    """A node paused past its TTL campaigns with a lease etcd no longer has: that is an
    EtcdUnavailableError for the loop to retry (never a raw gRPC error that would end the
    election thread), and the next try runs on a new lease."""
    m = Membership.from_endpoints(etcd_server.endpoint, cluster, "paused", ttl_s=TTL_S)  # no keepalive
    try:
        e = LeaderElection(m)
        old = m.ensure_lease()
        client.revoke_lease(old)  # what expiry does while the process is stopped
        with pytest.raises(EtcdUnavailableError, match="lease had expired"):
            e.campaign()
        assert e.campaign() is True
        assert m.lease_id != old and e.is_leader
    finally:
        m.close()
