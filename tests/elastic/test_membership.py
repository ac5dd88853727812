"""Membership against a real etcd: records, leases, outages, watches."""

from __future__ import annotations

import threading
import time

import pytest

from planaria.elastic.errors import EtcdUnavailableError
from planaria.elastic.keys import EngineRecord, EngineRecordState, NodeInfo
from planaria.elastic.membership import Membership
from tests.elastic.conftest import TTL_S, wait_for


def node(node_id: str) -> NodeInfo:
    return NodeInfo(node_id=node_id, host="127.0.0.1", addresses={"admin": "127.0.0.1:1"},
                    capacity={"num_engines": 2}, started_at=time.time())


def engine(engine_id: str, node_id: str, **kw) -> EngineRecord:
    return EngineRecord(engine_id=engine_id, node_id=node_id, **kw)


def test_put_and_list_records(make_membership, client, cluster):
    m = make_membership("n1")
    m.register_node(node("n1"))
    m.put_engine(engine("e0", "n1", rank=0, epoch=1, state=EngineRecordState.SERVING,
                        kv_cache_bytes=1 << 30, kv_source="profiled"))
    m.put_engine(engine("e1", "n1"))
    assert [n.node_id for n in m.list_nodes()] == ["n1"]
    engines = {e.engine_id: e for e in m.list_engines()}
    assert engines["e0"].state is EngineRecordState.SERVING
    assert engines["e0"].kv_cache_bytes == 1 << 30
    assert engines["e1"].rank is None
    # Human-readable JSON on the node's lease.
    value, meta = client.get(f"/planaria/{cluster}/engines/e0")
    assert b'"state":"serving"' in value
    assert meta.lease_id == m.lease_id
    m.remove_engine("e1")
    assert [e.engine_id for e in m.list_engines()] == ["e0"]


def test_register_node_rejects_other_node(make_membership):
    m = make_membership("n1")
    with pytest.raises(ValueError):
        m.register_node(node("n2"))


def test_close_revokes_and_deletes_keys(etcd_server, make_membership, cluster):
    m = Membership.from_endpoints(etcd_server.endpoint, cluster, "n1", ttl_s=TTL_S).start()
    m.put_engine(engine("e0", "n1"))
    observer = make_membership("observer")
    assert len(observer.list_engines()) == 1
    m.close()
    assert observer.list_engines() == []


def test_lease_expiry_deletes_keys_of_dead_supervisor(etcd_server, make_membership, cluster):
    dead = Membership.from_endpoints(etcd_server.endpoint, cluster, "n1", ttl_s=TTL_S).start()
    dead.register_node(node("n1"))
    dead.put_engine(engine("e0", "n1"))
    observer = make_membership("n2")
    assert len(observer.list_engines()) == 1
    died_at = time.monotonic()
    dead.close(revoke=False)            # the supervisor dies: keepalive stops, no revoke
    assert wait_for(lambda: not observer.list_engines() and not observer.list_nodes(),
                    timeout_s=TTL_S + 3)
    assert time.monotonic() - died_at >= TTL_S - 1.0  # kept alive until then, not revoked


def test_keepalive_holds_keys_beyond_ttl(make_membership):
    m = make_membership("n1")
    m.put_engine(engine("e0", "n1"))
    lease_id = m.lease_id
    time.sleep(TTL_S * 2)
    assert [e.engine_id for e in m.list_engines()] == ["e0"]
    assert m.lease_id == lease_id and m.has_valid_lease and m.is_connected


def test_revoked_lease_is_regranted_and_keys_rewritten(make_membership, client):
    m = make_membership("n1")
    m.register_node(node("n1"))
    m.put_engine(engine("e0", "n1"))
    old_lease = m.lease_id
    changes = []
    m.add_lease_listener(lambda old, new: changes.append((old, new)))
    client.revoke_lease(old_lease)      # as if the lease had expired server-side
    assert wait_for(lambda: m.lease_id not in (None, old_lease)
                    and len(m.list_engines()) == 1 and len(m.list_nodes()) == 1,
                    timeout_s=TTL_S)
    assert changes[0] == (old_lease, None)
    assert changes[-1] == (None, m.lease_id)
    _value, meta = client.get(m.layout.engine("e0"))
    assert meta.lease_id == m.lease_id


def test_etcd_down_writes_fail_fast_and_reads_too(private_etcd, cluster):
    m = Membership.from_endpoints(private_etcd.endpoint, cluster, "n1", ttl_s=TTL_S).start()
    try:
        m.put_engine(engine("e0", "n1"))
        private_etcd.kill()
        for call in (lambda: m.put_engine(engine("e1", "n1")),
                     lambda: m.remove_engine("e0"),
                     lambda: m.register_node(node("n1")),
                     m.list_engines):
            started = time.monotonic()
            with pytest.raises(EtcdUnavailableError) as info:
                call()
            assert time.monotonic() - started < 3.0
            assert info.value.__cause__ is not None      # the transport error is kept
        assert wait_for(lambda: not m.is_connected, timeout_s=3)
    finally:
        m.close(revoke=False)


def test_writes_fail_fast_when_etcd_hangs(private_etcd, cluster):
    """SIGSTOP: the port accepts but nothing answers; the RPC timeout bounds the call."""
    import os
    import signal
    m = Membership.from_endpoints(private_etcd.endpoint, cluster, "n1", ttl_s=TTL_S).start()
    try:
        m.put_engine(engine("e0", "n1"))
        os.kill(private_etcd.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(EtcdUnavailableError):
                m.put_engine(engine("e1", "n1"))
            assert time.monotonic() - started < 3.0
        finally:
            os.kill(private_etcd.pid, signal.SIGCONT)
    finally:
        m.close(revoke=False)


def test_etcd_killed_and_restarted_membership_reconverges(private_etcd, cluster):
    m = Membership.from_endpoints(private_etcd.endpoint, cluster, "n1", ttl_s=TTL_S).start()
    seen: dict[str, EngineRecord | None] = {}
    lock = threading.Lock()

    def on_change(engine_id: str, record: EngineRecord | None) -> None:
        with lock:
            seen[engine_id] = record

    try:
        m.register_node(node("n1"))
        m.put_engine(engine("e0", "n1"))
        m.put_engine(engine("gone", "n1"))
        watch = m.watch_engines(on_change)
        assert watch.wait_watching(3)
        assert wait_for(lambda: set(seen) == {"e0", "gone"}, timeout_s=2)

        private_etcd.kill()
        # While etcd is down the supervisor keeps changing its intent.
        with pytest.raises(EtcdUnavailableError):
            m.put_engine(engine("e1", "n1", state=EngineRecordState.READY))
        with pytest.raises(EtcdUnavailableError):
            m.remove_engine("gone")
        time.sleep(TTL_S + 0.5)          # down longer than the TTL
        assert not m.is_connected

        private_etcd.start()             # same data dir, same port
        back_at = time.monotonic()
        assert wait_for(lambda: m.is_connected and
                        sorted(e.engine_id for e in m.list_engines()) == ["e0", "e1"],
                        timeout_s=TTL_S)
        assert time.monotonic() - back_at < TTL_S
        assert [n.node_id for n in m.list_nodes()] == ["n1"]
        # The watch came back by itself, caught up on the changes, and still works.
        assert wait_for(lambda: seen.get("e1") is not None and seen.get("gone", 1) is None,
                        timeout_s=3)
        m.put_engine(engine("e2", "n1"))
        assert wait_for(lambda: seen.get("e2") is not None, timeout_s=3)
        # And the lease is alive: the keys outlive another TTL.
        time.sleep(TTL_S + 0.5)
        assert sorted(e.engine_id for e in m.list_engines()) == ["e0", "e1", "e2"]
    finally:
        m.close(revoke=False)


def test_etcd_data_lost_keys_rewritten(private_etcd, tmp_path, cluster):
    """etcd comes back empty (data dir wiped): the lease is gone, keys are re-created."""
    import shutil
    m = Membership.from_endpoints(private_etcd.endpoint, cluster, "n1", ttl_s=TTL_S).start()
    try:
        m.put_engine(engine("e0", "n1"))
        old_lease = m.lease_id
        private_etcd.kill()
        shutil.rmtree(private_etcd.data_dir / "member-data")
        private_etcd.start()
        assert wait_for(lambda: m.is_connected and m.lease_id not in (None, old_lease)
                        and [e.engine_id for e in m.list_engines()] == ["e0"],
                        timeout_s=TTL_S + 1)
    finally:
        m.close(revoke=False)


def test_watch_engines_sees_puts_and_deletes(make_membership):
    m = make_membership("n1")
    m.put_engine(engine("e0", "n1"))
    events: list[tuple[str, EngineRecord | None]] = []
    watch = m.watch_engines(lambda i, r: events.append((i, r)))
    assert watch.wait_watching(3)
    m.put_engine(engine("e1", "n1", state=EngineRecordState.READY))
    m.remove_engine("e0")
    assert wait_for(lambda: len(events) >= 3, timeout_s=3)
    assert events[0][0] == "e0" and events[0][1] is not None       # initial contents
    assert events[1][0] == "e1" and events[1][1].state is EngineRecordState.READY
    assert events[2] == ("e0", None)


def test_forget_engine_deletes_only_the_dead_incarnations_record(make_membership, client, cluster):
    from planaria.elastic.keys import EngineRecord, EngineRecordState
    from planaria.elastic.membership import forget_engine

    m = make_membership("engine-e1")
    layout = m.layout
    m.put_engine(EngineRecord(engine_id="e1", node_id="n", state=EngineRecordState.SERVING, addresses={"pid": "111"}))
    # The supervisor saw pid 100 die, but pid 111 (the restarted engine) wrote the record since.
    assert not forget_engine(client, layout, "e1", 100)
    assert client.get(layout.engine("e1"))[0] is not None
    assert forget_engine(client, layout, "e1", 111)
    assert client.get(layout.engine("e1"))[0] is None
    assert not forget_engine(client, layout, "e1", 111)  # nothing left to delete
