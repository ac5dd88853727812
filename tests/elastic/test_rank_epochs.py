"""A rank's epoch state machine (elastic/rank_epochs.py), table-driven: every transition of
the module docstring, and the failure that arrives while an epoch is pending."""

from __future__ import annotations

import pytest

from planaria.elastic.keys import Epoch
from planaria.elastic.rank_epochs import Arrive, Form, Leave, RankEpochs, RankPhase, Refuse

ME = "n-e1"


def epoch(number: int, *ranks: str) -> Epoch:
    return Epoch(number=number, world_size=len(ranks), ranks=list(ranks), expert_map=[0] * 4)


def serving(number: int, *ranks: str) -> RankEpochs:
    """A rank serving ``number``'s group."""
    r = RankEpochs(ME)
    r.offer(epoch(number, *ranks))
    assert r.take() == Arrive(epoch(number, *ranks))
    assert r.all_arrived() == Form(epoch(number, *ranks))
    r.formed()
    return r


def outside() -> RankEpochs:
    return RankEpochs(ME)


def preparing(number: int) -> RankEpochs:
    r = RankEpochs(ME)
    r.offer(epoch(number, "n-e0", ME))
    r.take()
    return r


# (name, start, offered epoch or None, action expected from take(), phase after, seen after)
TAKE_CASES = [
    ("outside, named: prepare", outside, epoch(1, "n-e0", ME), Arrive(epoch(1, "n-e0", ME)),
     RankPhase.PREPARING, -1),
    ("outside, not named: remembered", outside, epoch(1, "n-e0"), None, RankPhase.OUTSIDE, 1),
    ("outside, nothing new", outside, None, None, RankPhase.OUTSIDE, -1),
    ("preparing, newer names us: prepare that", lambda: preparing(1), epoch(2, ME, "n-e2"),
     Arrive(epoch(2, ME, "n-e2")), RankPhase.PREPARING, -1),
    ("preparing, newer does not name us: outside", lambda: preparing(1), epoch(2, "n-e0"), None,
     RankPhase.OUTSIDE, 2),
    ("preparing, nothing new", lambda: preparing(1), None, None, RankPhase.PREPARING, -1),
    ("serving, newer: pending", lambda: serving(1, "n-e0", ME), epoch(2, "n-e0"), None,
     RankPhase.SERVING, -1),
    ("serving, nothing new", lambda: serving(1, "n-e0", ME), None, None, RankPhase.SERVING, -1),
]


@pytest.mark.parametrize("name,start,offered,action,phase,seen", TAKE_CASES, ids=[c[0] for c in TAKE_CASES])
def test_take(name, start, offered, action, phase, seen):
    r = start()
    if offered is not None:
        r.offer(offered)
    assert r.take() == action
    assert r.phase is phase
    assert r.seen == seen


def test_serving_keeps_the_newest_pending_epoch():
    r = serving(1, "n-e0", ME)
    r.offer(epoch(2, "n-e0"))
    r.take()
    r.offer(epoch(3, "n-e0", ME, "n-e2"))
    r.take()
    assert r.pending_number == 3 and r.current.number == 1


@pytest.mark.parametrize("pending,action,phase", [
    (epoch(2, "n-e0", ME, "n-e2"), Form(epoch(2, "n-e0", ME, "n-e2")), RankPhase.FORMING),
    (epoch(2, "n-e0"), Leave("scaled down: not a rank of epoch 2"), RankPhase.LEFT),
], ids=["names us: form", "does not: leave"])
def test_switch_agreed(pending, action, phase):
    r = serving(1, "n-e0", ME)
    r.offer(pending)
    r.take()
    assert r.switch_agreed() == action
    assert r.phase is phase and r.pending is None


def test_formed_serves_the_new_epoch():
    r = serving(1, "n-e0", ME)
    r.offer(epoch(2, "n-e0", ME, "n-e2"))
    r.take()
    r.switch_agreed()
    assert r.formed().number == 2
    assert (r.phase, r.current.number, r.served, r.target) == (RankPhase.SERVING, 2, 2, None)


def test_a_failure_while_an_epoch_is_pending_joins_that_epoch():
    """The group of epoch 1 breaks (a departing rank exited mid-collective) while epoch 2,
    which the leader already wrote, is pending: the rank arrives at 2 at once. It used to
    remember 2 as taken and wait for the leader's abort (30 s)."""
    r = serving(1, "n-e0", ME, "n-e2")
    r.offer(epoch(2, "n-e0", ME))  # the scale-down epoch
    r.take()
    assert r.pending_number == 2
    r.failed_at(1)
    assert (r.phase, r.seen, r.failed) == (RankPhase.OUTSIDE, 1, 1)
    assert r.take() == Arrive(epoch(2, "n-e0", ME))


def test_a_failed_epoch_is_never_formed_again():
    r = preparing(2)
    r.all_arrived()
    r.failed_at(2)  # its group did not form
    assert r.take() is None and r.phase is RankPhase.OUTSIDE
    r.offer(epoch(3, "n-e0", ME))  # the leader's abort or re-form
    assert r.take() == Arrive(epoch(3, "n-e0", ME))


def test_a_failure_arriving_late_for_an_older_epoch_keeps_nothing_newer_from_being_taken():
    r = serving(1, "n-e0", ME)
    r.offer(epoch(4, "n-e0", ME))
    r.take()
    r.failed_at(1)
    r.failed_at(1)  # reported twice (a collective and the switch after it)
    assert r.take() == Arrive(epoch(4, "n-e0", ME))


def test_an_epoch_that_fails_this_ranks_checks_is_refused_once():
    r = RankEpochs(ME, problem=lambda e: "the expert map covers 4 experts, the model has 8")
    r.offer(epoch(1, ME))
    action = r.take()
    assert isinstance(action, Refuse) and action.epoch.number == 1
    assert r.take() is None and r.seen == 1


def test_a_stale_incarnations_epoch_is_skipped():
    r = RankEpochs(ME)
    r.offer(epoch(5, "n-e0", ME))  # written for this engine's previous process
    r.skip_stale()
    assert r.take() is None and r.seen == 5
    r.offer(epoch(6, "n-e0", ME))
    assert r.take() == Arrive(epoch(6, "n-e0", ME))


@pytest.mark.parametrize("start,expect", [
    (outside, Leave("left outside any group")),
    (lambda: preparing(1), None),  # others may be forming with us: form, then leave at a boundary
    (lambda: serving(1, "n-e0", ME), None),  # in a group: only at an epoch boundary
], ids=["outside: at once", "preparing: not yet", "serving: not mid-group"])
def test_a_leaving_rank_leaves_only_where_nobody_waits_on_it(start, expect):
    r = start()
    r.request_leave()
    assert r.take() == expect


def test_a_leaving_rank_whose_group_failed_leaves_instead_of_re_forming():
    r = serving(1, "n-e0", ME)
    r.request_leave()
    r.offer(epoch(2, "n-e0", ME))  # a re-form that still names it (its DRAINING not yet seen)
    r.take()
    r.failed_at(1)
    assert r.take() == Leave("left outside any group")  # it never arrived at 2: nobody waits


def test_a_leaving_rank_that_arrived_forms_then_leaves_at_the_boundary():
    r = preparing(2)
    r.request_leave()
    assert r.take() is None
    r.all_arrived()
    r.formed()
    r.offer(epoch(3, "n-e0"))
    r.take()
    assert r.switch_agreed() == Leave("scaled down: not a rank of epoch 3")


def test_exit_agreed_leaves_together():
    r = serving(1, "n-e0", ME)
    r.request_leave()
    assert r.exit_agreed() == Leave("every rank of the group left together")
    assert r.phase is RankPhase.LEFT
    r.failed_at(1)  # nothing moves a rank that left
    assert r.phase is RankPhase.LEFT and r.take() is None


@pytest.mark.parametrize("call,phase", [
    ("all_arrived", RankPhase.OUTSIDE), ("switch_agreed", RankPhase.OUTSIDE),
    ("exit_agreed", RankPhase.PREPARING), ("formed", RankPhase.SERVING),
])
def test_an_input_in_the_wrong_phase_is_refused(call, phase):
    r = {RankPhase.OUTSIDE: outside, RankPhase.PREPARING: lambda: preparing(1),
         RankPhase.SERVING: lambda: serving(1, ME)}[phase]()
    with pytest.raises(ValueError):
        getattr(r, call)()


def test_offer_keeps_only_the_newest():
    r = RankEpochs(ME)
    assert r.offer(epoch(3, ME))
    assert not r.offer(epoch(2, ME)) and not r.offer(epoch(3, ME))
    assert r.latest.number == 3


# -- the group's switch verdict (elastic/ep_engine.py sync_verdict) ---------------------------

from planaria.elastic.ep_engine import sync_verdict  # noqa: E402 - the table below is its own

VERDICTS = [
    ("every rank voted for it", ["a", "b", "c"], ["a", "b", "c", "d"], [5, 5, 5], 5, True),
    ("a continuing rank did not vote", ["a", "b", "c"], ["a", "b", "c", "d"], [5, 4, 5], 5, False),
    ("a leaving rank that never saw it does not hold the group", ["a", "b", "c"], ["a", "b"], [5, 5, 4], 5, True),
    ("a leaving rank's vote is not needed either way", ["a", "b", "c"], ["a", "b"], [5, 5, 5], 5, True),
    ("the only rank left voted", ["a", "b"], ["b"], [4, 5], 5, True),
    ("engine ids unknown: all must vote", [], [], [5, 4], 5, False),
    ("engine ids unknown, all voted", [], [], [5, 5], 5, True),
]


@pytest.mark.parametrize("name,current,new,votes,newest,want", VERDICTS, ids=[v[0] for v in VERDICTS])
def test_sync_verdict(name, current, new, votes, newest, want):
    assert sync_verdict(current, new, votes, newest) is want
