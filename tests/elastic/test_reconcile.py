"""The leader's pure decision (elastic/reconcile.py ``decide``), table-driven: one frozen
view in, the actions and the summary out, for every branch (launch, wait and abort too)."""

from __future__ import annotations

import pytest

from planaria.elastic.keys import Desired, EngineRecord, EngineRecordState, Epoch, KVBudget, NodeInfo, OpPhase, \
    OpRecord
from planaria.elastic.placement import Placement
from planaria.elastic.planner import Reform, ScaleDown, ScaleUp, expert_map
from planaria.elastic.reconcile import (AbortSwitch, ClusterView, Launch, Launched, Memory, Publish, Refused,
                                        Settings, UpdateOp, WriteEpoch, decide)

RDV = "127.0.0.1:29500"
NOW = 1000.0
S = EngineRecordState


def epoch(number=3, ranks=("n-e0", "n-e1"), created_at=NOW - 5):
    return Epoch(number=number, world_size=len(ranks), ranks=list(ranks), expert_map=expert_map(4, len(ranks)),
                 rendezvous=RDV, leader="n", created_at=created_at)


def rec(eid, state=S.SERVING, epoch_number=3, **kw):
    return EngineRecord(engine_id=eid, node_id=eid.split("-")[0], state=state, epoch=epoch_number,
                        served_epoch=kw.pop("served_epoch", epoch_number if state == S.SERVING else 0),
                        addresses={"engine_index": eid.rsplit("e", 1)[1], **kw.pop("addresses", {})}, **kw)


def node(nid="n", engines=2, max_engines=4):
    return NodeInfo(node_id=nid, host="127.0.0.1", addresses={"rendezvous": RDV},
                    capacity={"engines": engines, "max_engines": max_engines})


def op(target=3, op_id="op-1", phase=OpPhase.PENDING):
    return OpRecord(op_id=op_id, kind="scale", phase=phase, target=target)


def view(**kw) -> ClusterView:
    base = dict(now=NOW, epoch=epoch(), epoch_rev=7, nodes=(node(),), op=None, desired=None,
                records={"n-e0": rec("n-e0"), "n-e1": rec("n-e1")})
    base.update(kw)
    return ClusterView(**base)


def settings(**kw) -> Settings:
    base = dict(num_experts=4, rendezvous=RDV, leader="n", initial_engines=2, block_size=16,
                place_engines=False, can_launch=False)
    base.update(kw)
    return Settings(**base)


MEMORY = Memory(started_at=NOW - 500)


def kinds(decision):
    return [type(a).__name__ for a in decision.actions]


def written_epoch(decision):
    return next(a.action for a in decision.actions if isinstance(a, WriteEpoch))


# (name, view overrides, settings overrides, memory, expected action kinds, text in the summary)
CASES = [
    ("epoch refused: nothing else", dict(epoch_refused="epoch 3 refused: a rank twice"), {}, MEMORY,
     ["Refused"], "refused"),
    ("settled: no change", {}, {}, MEMORY, [], "world size 2 is the desired size"),
    ("bad desired counts as the world size", dict(desired_refused="not JSON"), {}, MEMORY,
     ["Refused"], "world size 2 is the desired size"),
    ("desired past the capacity", dict(desired=Desired(num_engines=9, op_id="op-1")), dict(place_engines=True),
     MEMORY, ["Refused", "WritePlacement"], "world size 2"),
    ("bad op: driven by nobody", dict(op_refused="op refused: deep"), {}, MEMORY, ["Refused"], "desired size"),
    ("unknown rendezvous: logged, not refused",
     dict(epoch=Epoch(number=3, world_size=2, ranks=["n-e0", "n-e1"], expert_map=[0, 0, 1, 1],
                      rendezvous="10.6.6.6:1")), {}, MEMORY, ["Refused"], "world size 2"),
    ("placed: this node not registered yet", dict(nodes=(node("other"),)), dict(place_engines=True), MEMORY,
     [], "waiting for this node's record"),
    ("placed: settled placement", dict(placement=Placement(engines={"n": 2}, target=2)), dict(place_engines=True),
     MEMORY, [], "placed"),
    ("no epoch yet, too few live, in grace: wait", dict(epoch=None, records={"n-e0": rec("n-e0", S.READY)}),
     {}, Memory(started_at=NOW - 10), [], "waiting for engines: 1/2 live"),
    ("no epoch yet, grace over: start with what is live", dict(epoch=None, records={"n-e0": rec("n-e0", S.READY)}),
     {}, Memory(started_at=NOW - 500), ["WriteEpoch"], "ScaleUp -> epoch 1"),
    ("a dead rank: re-form at once", dict(records={"n-e0": rec("n-e0")}), {}, MEMORY, ["WriteEpoch"],
     "Reform -> epoch 4"),
    ("a draining rank: re-form without it", dict(records={"n-e0": rec("n-e0"), "n-e1": rec("n-e1", S.DRAINING)}),
     {}, MEMORY, ["WriteEpoch"], "Reform -> epoch 4"),
    ("desired up, joiner live: scale up", dict(desired=Desired(num_engines=3, op_id="op-1"), op=op(3),
                                               records={"n-e0": rec("n-e0"), "n-e1": rec("n-e1"),
                                                        "n-e2": rec("n-e2", S.READY, 0)}),
     {}, MEMORY, ["WriteEpoch", "UpdateOp"], "ScaleUp -> epoch 4"),
    ("desired up, joiner not live: wait", dict(desired=Desired(num_engines=3, op_id="op-1"), op=op(3)),
     {}, MEMORY, [], "waiting for joining engines: 0/1 live"),
    ("desired down mid-switch: one switch at a time",
     dict(desired=Desired(num_engines=1, op_id="op-1"), op=op(1),
          records={"n-e0": rec("n-e0"), "n-e1": rec("n-e1", S.SERVING, 2, served_epoch=2)}),
     {}, MEMORY, [], "switching to epoch 3"),
    ("a rank failed the switch: abort", dict(desired=Desired(num_engines=3, op_id="op-1"), op=op(3),
                                             epoch=epoch(4, ("n-e0", "n-e1", "n-e2")),
                                             records={"n-e0": rec("n-e0", S.UNHEALTHY, 3, served_epoch=3,
                                                                  failed_epoch=4, error="gloo"),
                                                      "n-e1": rec("n-e1", S.SERVING, 3),
                                                      "n-e2": rec("n-e2", S.READY, 0)}),
     {}, MEMORY, ["AbortSwitch"], "Abort of epoch 4 -> epoch 5"),
    ("a switch not served in time: abort", dict(epoch=epoch(4, created_at=NOW - 60),
                                                records={"n-e0": rec("n-e0", S.SERVING, 3),
                                                         "n-e1": rec("n-e1", S.SERVING, 3)}),
     {}, MEMORY, ["AbortSwitch"], "Abort of epoch 4"),
    ("served at the target: op done", dict(desired=Desired(num_engines=2, op_id="op-1"), op=op(2)),
     {}, MEMORY, ["UpdateOp"], "world size 2"),
    ("launching: missing engines are launched", dict(desired=Desired(num_engines=3, op_id="op-1"), op=op(3),
                                                     kv_figure=5 << 20),
     dict(can_launch=True), MEMORY, ["Launch", "UpdateOp"], "launched 1"),
    ("launching: not while a rank is dead", dict(desired=Desired(num_engines=3, op_id="op-1"),
                                                 records={"n-e0": rec("n-e0")}),
     dict(can_launch=True), MEMORY, ["WriteEpoch"], "Reform"),
    ("launching: a launch in flight is not repeated", dict(desired=Desired(num_engines=3, op_id="op-1")),
     dict(can_launch=True), Memory(started_at=NOW - 500, launched={"n-e9": NOW - 1}), [],
     "waiting for joining engines"),
]


@pytest.mark.parametrize("name,view_kw,settings_kw,memory,expect,summary", CASES, ids=[c[0] for c in CASES])
def test_decide(name, view_kw, settings_kw, memory, expect, summary):
    decision = decide(view(**view_kw), memory, settings(**settings_kw))
    assert [k for k in kinds(decision) if k != "Publish"] == expect, decision
    assert summary in decision.summary, decision


def test_scale_up_appends_the_joiner_and_marks_the_op_switching():
    d = decide(view(desired=Desired(num_engines=3, op_id="op-1"), op=op(3),
                    records={"n-e0": rec("n-e0"), "n-e1": rec("n-e1"), "n-e2": rec("n-e2", S.READY, 0)}),
               MEMORY, settings())
    new = written_epoch(d)
    assert isinstance(new, ScaleUp) and new.epoch.ranks == ["n-e0", "n-e1", "n-e2"] and new.joining == ["n-e2"]
    assert d.actions[0].expected_rev == 7  # the CAS base is the revision the view read
    assert d.actions[1] == UpdateOp("op-1", OpPhase.SWITCHING, "epoch 4: ScaleUp to 3 ranks")


def test_a_draining_rank_is_left_out_whatever_desired_says():
    d = decide(view(desired=Desired(num_engines=2, op_id="op-1"),
                    records={"n-e0": rec("n-e0", S.DRAINING), "n-e1": rec("n-e1")}), MEMORY, settings())
    new = written_epoch(d)
    assert isinstance(new, Reform) and new.epoch.ranks == ["n-e1"] and new.dead == ["n-e0"]


def test_placed_scale_down_writes_the_placement_then_the_epoch_over_what_it_keeps():
    d = decide(view(desired=Desired(num_engines=1, op_id="op-1"), op=op(1),
                    placement=Placement(engines={"n": 2}, target=2)), MEMORY, settings(place_engines=True))
    assert kinds(d) == ["WritePlacement", "UpdateOp", "WriteEpoch", "UpdateOp"]
    assert d.actions[0].placement.engines == {"n": 1}
    new = written_epoch(d)
    assert isinstance(new, ScaleDown) and new.epoch.ranks == ["n-e0"] and new.departing == ["n-e1"]


def test_abort_rolls_desired_back_only_for_its_own_op():
    failing = dict(epoch=epoch(4, ("n-e0", "n-e1", "n-e2")),
                   records={"n-e0": rec("n-e0", S.UNHEALTHY, 3, served_epoch=3, failed_epoch=4),
                            "n-e1": rec("n-e1", S.SERVING, 3), "n-e2": rec("n-e2", S.READY, 0)})
    own = decide(view(desired=Desired(num_engines=3, op_id="op-1", requested_at=5.0), op=op(3), **failing),
                 MEMORY, settings()).actions[0]
    assert isinstance(own, AbortSwitch) and own.abort.epoch.ranks == ["n-e0", "n-e1"]
    assert own.rolled_back == Desired(num_engines=2, op_id="op-1", requested_at=5.0)
    other = decide(view(desired=Desired(num_engines=3, op_id="op-2"), op=op(3), **failing),
                   MEMORY, settings()).actions[0]
    assert other.rolled_back is None and other.op == op(3)


def test_kv_figures_are_published_once_and_bad_ones_skipped():
    records = {"n-e0": rec("n-e0", kv_source="profiled", kv_cache_bytes=8 << 20,
                           addresses={"num_kv_blocks": "64"}),
               "n-e1": rec("n-e1", kv_source="profiled", kv_cache_bytes=8 << 20,
                           addresses={"num_kv_blocks": "lots"}),
               "n-e2": rec("n-e2", S.READY, 0, kv_source="reused", kv_cache_bytes=8 << 20,
                           addresses={"num_kv_blocks": "64"})}
    d = decide(view(records=records), MEMORY, settings())
    pubs = [a for a in d.actions if isinstance(a, Publish)]
    assert pubs == [Publish(KVBudget(kv_cache_bytes=8 << 20, block_size=16, num_blocks=64, engine_id="n-e0",
                                     recorded_at=NOW))]
    again = decide(view(records=records), Memory(started_at=0, published=frozenset({"n-e0"})), settings())
    assert not [a for a in again.actions if isinstance(a, Publish)]


@pytest.mark.parametrize("reuse,figure", [(True, 5 << 20), (False, None)])
def test_a_launch_reuses_the_groups_kv_figure_unless_told_not_to(reuse, figure):
    d = decide(view(desired=Desired(num_engines=3, op_id="op-1"), kv_figure=5 << 20), MEMORY,
               settings(can_launch=True, reuse_kv=reuse))
    assert d.actions[0] == Launch(1, figure)


def test_launches_are_forgotten_once_registered_or_timed_out():
    memory = Memory(started_at=0, launched={"n-e2": NOW - 1, "n-e3": NOW - 400, "n-e4": NOW - 2})
    d = decide(view(records={"n-e0": rec("n-e0"), "n-e1": rec("n-e1"), "n-e2": rec("n-e2", S.LOADING, 0)}),
               memory, settings(can_launch=True))
    assert Launched({"n-e4": NOW - 2}) in d.actions


def test_refusals_come_first_and_name_the_record():
    d = decide(view(op_refused="op refused: nested too deep", desired_refused="bad"), MEMORY, settings())
    assert d.actions[:2] == (Refused("op refused: nested too deep"), Refused("desired refused: bad"))
