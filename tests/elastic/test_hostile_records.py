"""Nothing read from etcd is trusted: hostile records written straight into a real etcd are
refused (decode), skipped by listings and watches (which go on), and not acted on by the
leader's controller (a bogus epoch or desired size changes nothing; a forged rendezvous is
logged as an error)."""

from __future__ import annotations

import json

import pytest

from planaria.elastic.controller import placement_problem
from planaria.elastic.errors import RecordDecodeError
from planaria.elastic.keys import (Desired, EngineRecord, EngineRecordState, Epoch, KeyLayout, NodeInfo, decode,
                                   desired_problem, encode, epoch_problem)
from planaria.elastic.placement import Placement
from tests.elastic.conftest import GOOD_EPOCH, wait_for


def _epoch(**changes) -> bytes:
    return json.dumps({**GOOD_EPOCH, **changes}).encode()


HOSTILE_EPOCHS = {
    "world size is not the rank count": _epoch(world_size=3),
    "a rank twice": _epoch(ranks=["n-e0", "n-e0"]),
    "an expert past the ranks": _epoch(expert_map=[0, 0, 1, 2]),
    "a negative expert rank": _epoch(expert_map=[0, -1, 1, 1]),
    "experts not contiguous": _epoch(expert_map=[0, 1, 0, 1]),
    "a rank id with a slash": _epoch(ranks=["n-e0", "../x"]),
    "a huge string": _epoch(ranks=["n-e0", "x" * 100_000]),
    "an infinite time": _epoch().replace(b"}", b', "created_at": 1e999}'),
    "a negative number": _epoch(number=-4),
    "a rendezvous that is not host:port": _epoch(rendezvous="evil"),
    "not JSON": b"\x00\xffnot json",
    "the wrong type": _epoch(world_size="2"),
    "deep nesting": b'{"number": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "an array": b"[1, 2, 3]",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_EPOCHS))
def test_hostile_epoch_is_refused(name):
    with pytest.raises(RecordDecodeError):
        decode("/planaria/c/epoch", HOSTILE_EPOCHS[name], Epoch)


def test_a_good_epoch_passes_and_context_checks_need_context():
    epoch = decode("/planaria/c/epoch", _epoch(), Epoch)
    assert epoch.ranks == ["n-e0", "n-e1"]
    assert epoch_problem(epoch, num_experts=4, rendezvous_addresses=["127.0.0.1:29500"]) is None
    assert "covers 4 experts" in epoch_problem(epoch, num_experts=8)
    assert "no known node" in epoch_problem(epoch, rendezvous_addresses=["10.0.0.1:29500"])


@pytest.mark.parametrize("value", [{"num_engines": 10**9, "op_id": "op"}, {"num_engines": -1, "op_id": "op"},
                                   {"num_engines": 2, "op_id": ""}, {"num_engines": 2.5, "op_id": "op"}])
def test_hostile_desired_is_refused(value):
    with pytest.raises(RecordDecodeError):
        decode("/planaria/c/desired", json.dumps(value).encode(), Desired)


def test_desired_size_within_one_and_max():
    assert desired_problem(Desired(num_engines=0, op_id="o"), 4)
    assert desired_problem(Desired(num_engines=5, op_id="o"), 4)
    assert desired_problem(Desired(num_engines=4, op_id="o"), 4) is None


def test_placement_over_a_nodes_max_engines_is_refused():
    nodes = [NodeInfo(node_id="a", host="h", capacity={"engines": 1, "max_engines": 2})]
    assert placement_problem(Placement(engines={"a": 2}, target=2), nodes) is None
    assert "over its --max-engines" in placement_problem(Placement(engines={"a": 500}, target=500), nodes)
    assert placement_problem(Placement(engines={"a": 1}, target=10**6), nodes)


def test_listing_and_watching_skip_hostile_records_and_go_on(client, make_membership, cluster):
    layout = KeyLayout(cluster)
    m = make_membership("n")
    seen: dict[str, EngineRecord | None] = {}
    m.watch_engines(lambda eid, rec: seen.__setitem__(eid, rec))
    client.put(layout.engines_prefix + "bad", b'{"engine_id": "bad", "node_id": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    client.put(layout.engines_prefix.encode() + b"\xff\xfe", b"{}")  # a key that is not UTF-8
    client.put(layout.engines_prefix + "huge", json.dumps({"engine_id": "huge", "node_id": "n",
                                                           "error": "x" * 10**6}).encode())
    good = EngineRecord(engine_id="good", node_id="n", state=EngineRecordState.SERVING)
    client.put(layout.engine("good"), encode(good))
    assert wait_for(lambda: "good" in seen, 20), seen
    assert seen["good"] == good and not {"bad", "huge"} & set(seen)
    assert [r.engine_id for r in m.list_engines()] == ["good"]
    client.put(layout.engine("later"), encode(EngineRecord(engine_id="later", node_id="n")))
    assert wait_for(lambda: "later" in seen, 20), "the watch stopped after the hostile records"


@pytest.mark.parametrize("desired", [b'{"num_engines": 0, "op_id": "op-x"}', b'{"num_engines": 100000, "op_id": "x"}',
                                     b'{"num_engines": "lots"}', b"[" * 100_000])
def test_leader_does_not_act_on_a_bogus_desired_size(leader, desired):
    c, client, layout, store = leader
    before = store.read_epoch()
    client.put(layout.desired, desired)
    action = c.tick()
    assert store.read_epoch() == before, action  # no epoch written: the cluster stays at 2
    assert "world size 2 is the desired size" in action


@pytest.mark.parametrize("name", ["world size is not the rank count", "a rank twice", "deep nesting"])
def test_leader_does_not_act_on_a_bogus_epoch(leader, name):
    c, client, layout, store = leader
    client.put(layout.epoch, HOSTILE_EPOCHS[name])
    value_before = client.get(layout.epoch)[0]
    assert "epoch" in c.tick() and "refused" in c.tick()
    assert client.get(layout.epoch)[0] == value_before


def test_a_forged_rendezvous_is_logged_not_followed_by_the_leader(leader):
    c, client, layout, store = leader
    client.put(layout.epoch, _epoch(number=9, rendezvous="10.6.6.6:1234"))
    c.tick()
    assert any("no known node" in r for r in c._refusals)
    epoch, _rev = store.read_epoch()
    assert epoch.number == 9  # the leader's own next epoch will be at its own rendezvous


def test_an_ep_engine_refuses_an_epoch_at_an_unknown_rendezvous(make_membership, cluster, tmp_path):
    """The engine's own check (elastic/ep_proc.py) before it acts on an epoch: its
    consistency, the model's expert count, and a rendezvous among the node records in etcd."""
    from planaria.elastic.ep_proc import EPEngineCoreProc
    from planaria.engine.config import EngineConfig
    from planaria.engine.demo_model import build_demo_model

    model = tmp_path / "tiny-moe"
    build_demo_model(model, "tiny-moe", progress=lambda _: None)
    from planaria.engine.models.loader import load_hf_config, spec_from_config

    num_experts = spec_from_config(load_hf_config(str(model))).num_experts
    m = make_membership("n")
    m.register_node(NodeInfo(node_id="n", host="127.0.0.1", addresses={"rendezvous": "127.0.0.1:29500"}))
    proc = EPEngineCoreProc(0, "n-e0", "n", [], EngineConfig(model=str(model)), [], cluster)
    proc._membership = m
    half = num_experts // 2
    good = Epoch(number=3, world_size=2, ranks=["n-e0", "n-e1"], expert_map=[0] * half + [1] * half,
                 rendezvous="127.0.0.1:29500")
    assert proc._epoch_refusal(good) is None
    short = Epoch(**{**{f: getattr(good, f) for f in good.__struct_fields__}, "expert_map": [0, 1]})
    # before the model's load (on the main thread) read the config, the watch thread does
    # not read it itself (transformers' lazy imports race): the expert count waits
    assert proc._epoch_refusal(short) is None and proc._num_experts is None
    proc._num_experts = num_experts  # what the load sets
    forged = Epoch(**{**{f: getattr(good, f) for f in good.__struct_fields__}, "rendezvous": "10.6.6.6:1234"})
    assert "no known node" in proc._epoch_refusal(forged)
    assert f"model has {num_experts}" in proc._epoch_refusal(short)
