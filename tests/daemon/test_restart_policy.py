"""Restart policy and flap detector: table-driven, fake clock (plain floats)."""

from __future__ import annotations

import pytest

from planaria.daemon.flapping import FlapDetector
from planaria.daemon.restart_policy import GiveUp, HoldOff, RestartAt, RestartNow, RestartPolicy

BASE = dict(backoff_initial_s=1.0, backoff_max_s=8.0, backoff_factor=2.0,
            flap_window_s=10.0, flap_max_exits=4, flap_hold_s=30.0, retry_limit=None)


def replay(policy: RestartPolicy, events: list[tuple], child_id="engine-0") -> None:
    for kind, now in events:
        if kind == "start":
            policy.record_start(child_id, now)
        elif kind == "exit":
            policy.record_exit(child_id, now, exit_code=1, reason="crashed")
        elif kind == "healthy":
            policy.record_healthy(child_id, now)
        elif kind == "served":
            policy.record_served(child_id, now)
        else:
            raise ValueError(kind)


def served_deaths(times: list[float], run_s: float = 0.5) -> list[tuple]:
    """Start at each t, do work, be killed run_s later (from outside: OOM killer, an operator)."""
    events = []
    for t in times:
        events += [("start", t), ("served", t + run_s / 2), ("exit", t + run_s)]
    return events


def crash_loop(times: list[float], run_s: float = 0.0) -> list[tuple]:
    """Start at each t, exit run_s later."""
    events = []
    for t in times:
        events += [("start", t), ("exit", t + run_s)]
    return events


CASES = [
    # (id, overrides, events, decide at, expected action)
    ("never failed", {}, [("start", 0.0)], 5.0, RestartNow()),
    ("unknown child", {}, [], 0.0, RestartNow()),
    ("first failure waits initial backoff", {}, crash_loop([0.0], 1.0), 1.5, RestartAt(2.0)),
    ("first failure after backoff", {}, crash_loop([0.0], 1.0), 2.0, RestartNow()),
    ("second failure doubles", {}, crash_loop([0.0, 2.0], 1.0), 3.0, RestartAt(5.0)),
    ("third failure doubles again", {}, crash_loop([0.0, 2.0, 5.0], 1.0), 6.0, RestartAt(10.0)),
    ("backoff capped at max", dict(flap_max_exits=100),
     crash_loop([0.0, 10.0, 20.0, 30.0, 40.0, 50.0], 1.0), 51.0, RestartAt(59.0)),
    ("zero initial backoff restarts at once", dict(backoff_initial_s=0.0),
     crash_loop([0.0, 1.0], 0.5), 1.5, RestartNow()),
    ("factor 1 keeps a constant delay", dict(backoff_factor=1.0, flap_max_exits=100),
     crash_loop([0.0, 10.0, 20.0], 1.0), 21.0, RestartAt(22.0)),
    ("healthy resets backoff", {},
     crash_loop([0.0, 2.0, 5.0], 1.0) + [("start", 10.0), ("healthy", 20.0), ("exit", 25.0)],
     25.0, RestartAt(26.0)),
    ("healthy before stable_s does not reset", dict(stable_s=60.0),
     crash_loop([0.0, 2.0], 1.0) + [("start", 5.0), ("healthy", 20.0), ("exit", 25.0)],
     25.0, RestartAt(29.0)),
    ("healthy after stable_s resets", dict(stable_s=60.0),
     crash_loop([0.0, 2.0], 1.0) + [("start", 5.0), ("healthy", 65.0), ("exit", 70.0)],
     70.0, RestartAt(71.0)),
    ("healthy while not running is ignored", {},
     crash_loop([0.0, 2.0], 1.0) + [("healthy", 3.5)], 3.5, RestartAt(5.0)),
    ("flapping holds off", dict(backoff_initial_s=0.0),
     crash_loop([0.0, 1.0, 2.0, 3.0], 0.5), 4.0,
     HoldOff(33.5, "flapping: 4 exits within 10s; holding off 30s")),
    ("exits spread wider than the window do not flap", dict(backoff_initial_s=0.0),
     crash_loop([0.0, 4.0, 8.0, 12.0], 0.5), 13.0, RestartNow()),
    ("after the hold the child is retried", dict(backoff_initial_s=0.0),
     crash_loop([0.0, 1.0, 2.0, 3.0], 0.5), 33.5, RestartNow()),
    ("after the hold the flap window is clean", dict(backoff_initial_s=0.0),
     crash_loop([0.0, 1.0, 2.0, 3.0], 0.5) + crash_loop([33.5, 34.0], 0.1), 34.2, RestartNow()),
    ("backoff longer than the hold wins", dict(backoff_initial_s=100.0, backoff_max_s=100.0),
     crash_loop([0.0, 1.0, 2.0, 3.0], 0.5), 40.0, RestartAt(103.5)),
    ("retry limit allows that many restarts", dict(retry_limit=2),
     crash_loop([0.0, 2.0], 1.0), 10.0, RestartNow()),
    ("retry limit 0 never restarts", dict(retry_limit=0),
     crash_loop([0.0], 1.0), 10.0,
     GiveUp("engine-0 failed 1 times in a row without becoming healthy (retry limit 0); "
            "last exit: code 1, crashed")),
    ("give up beats hold off", dict(retry_limit=3, backoff_initial_s=0.0),
     crash_loop([0.0, 1.0, 2.0, 3.0], 0.5), 4.0,
     GiveUp("engine-0 failed 4 times in a row without becoming healthy (retry limit 3); "
            "last exit: code 1, crashed")),
    ("healthy resets the retry count", dict(retry_limit=1),
     crash_loop([0.0], 1.0) + [("start", 3.0), ("healthy", 50.0), ("exit", 60.0)],
     61.0, RestartNow()),
    # -- deaths after serving: a small fixed delay, no backoff, no flap hold, a rate cap --
    ("a death after serving waits only the served delay", dict(served_delay_s=0.25),
     served_deaths([0.0]), 0.6, RestartAt(0.75)),
    ("deaths after serving never back off or flap", dict(served_delay_s=0.25),
     served_deaths([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), 6.5, RestartAt(6.75)),
    ("a served death ends a start-up streak", {},
     crash_loop([0.0, 2.0, 5.0], 1.0) + served_deaths([10.0]), 10.5, RestartNow()),
    ("start-up failures after a served death back off from the start", {},
     served_deaths([0.0]) + crash_loop([1.0], 0.5), 1.6, RestartAt(3.5)),
    ("the served rate cap: the next restart waits for the oldest to leave the window",
     dict(served_max_restarts=3), served_deaths([0.0, 1.0, 2.0, 3.0]), 3.5, RestartAt(10.5)),
    ("under the served rate cap no wait", dict(served_max_restarts=4),
     served_deaths([0.0, 1.0, 2.0, 3.0]), 3.5, RestartNow()),
    ("started but no work done is a start-up failure", {},
     [("start", 0.0), ("exit", 0.5)], 0.6, RestartAt(1.5)),
    ("a fatal exit code after serving still gives up", dict(fatal_exit_codes={1: "refused"}),
     served_deaths([0.0]), 1.0, GiveUp("refused (exit code 1); not restarted: fix the "
                                       "configuration, then `planaria restart`")),
]

# the availability floor: the child is its group's last one (decide(..., last_one=True))
FLOOR_CASES = [
    ("a flap hold is cut to the backoff cap", dict(backoff_initial_s=0.0),
     crash_loop([0.0, 1.0, 2.0, 3.0], 0.5), 4.0, RestartAt(11.5, floor=True)),
    ("past the cap at once", dict(backoff_initial_s=0.0),
     crash_loop([0.0, 1.0, 2.0, 3.0], 0.5), 12.0, RestartNow()),
    ("a backoff under the cap is kept", {}, crash_loop([0.0, 2.0], 1.0), 3.0, RestartAt(5.0)),
    ("the served rate cap is cut too", dict(served_max_restarts=3, flap_window_s=100.0),
     served_deaths([0.0, 1.0, 2.0, 3.0]), 3.5, RestartAt(11.5, floor=True)),
    ("give up stays give up", dict(retry_limit=0), crash_loop([0.0], 1.0), 2.0,
     GiveUp("engine-0 failed 1 times in a row without becoming healthy (retry limit 0); "
            "last exit: code 1, crashed")),
]


@pytest.mark.parametrize("overrides,events,now,expected",
                         [c[1:] for c in FLOOR_CASES], ids=[c[0] for c in FLOOR_CASES])
def test_decide_as_the_last_one(overrides, events, now, expected):
    policy = RestartPolicy(**{**BASE, **overrides})
    replay(policy, events)
    assert policy.decide("engine-0", now, last_one=True) == expected


@pytest.mark.parametrize("overrides,events,now,expected",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide(overrides, events, now, expected):
    policy = RestartPolicy(**{**BASE, **overrides})
    replay(policy, events)
    assert policy.decide("engine-0", now) == expected


def test_decide_has_no_side_effects():
    policy = RestartPolicy(**BASE)
    replay(policy, crash_loop([0.0, 2.0], 1.0))
    first = policy.decide("engine-0", 3.0)
    assert [policy.decide("engine-0", 3.0) for _ in range(3)] == [first] * 3


@pytest.mark.parametrize("num_failures,expected_s", [
    (0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 8.0), (10_000, 8.0),
])
def test_backoff_s(num_failures, expected_s):
    assert RestartPolicy(**BASE).backoff_s(num_failures) == expected_s


def test_children_are_independent_and_restarts_are_counted():
    policy = RestartPolicy(**BASE)
    replay(policy, crash_loop([0.0, 2.0, 5.0], 1.0), child_id="a")
    replay(policy, [("start", 0.0)], child_id="b")
    assert policy.restarts("a") == 2
    assert policy.restarts("b") == 0
    assert policy.restarts("never-seen") == 0
    assert policy.num_failures("a") == 3
    assert policy.decide("b", 6.0) == RestartNow()
    assert policy.last_exits("a") == [(1.0, 1, "crashed"), (3.0, 1, "crashed"),
                                      (6.0, 1, "crashed")]
    policy.forget("a")
    assert policy.decide("a", 6.0) == RestartNow()
    assert policy.restarts("a") == 0


def test_unknown_exit_code_in_give_up_reason():
    policy = RestartPolicy(**{**BASE, "retry_limit": 0})
    policy.record_start("e", 0.0)
    policy.record_exit("e", 1.0, exit_code=None, reason="SIGKILL")
    action = policy.decide("e", 2.0)
    assert isinstance(action, GiveUp)
    assert action.reason.endswith("last exit: unknown code, SIGKILL")


@pytest.mark.parametrize("overrides", [
    dict(backoff_initial_s=-1.0), dict(backoff_max_s=0.5), dict(backoff_factor=0.5),
    dict(flap_window_s=0.0), dict(flap_max_exits=0), dict(flap_hold_s=-1.0),
    dict(retry_limit=-1), dict(stable_s=-1.0), dict(served_delay_s=-1.0),
    dict(served_max_restarts=0),
])
def test_invalid_settings_raise(overrides):
    with pytest.raises(ValueError):
        RestartPolicy(**{**BASE, **overrides})


FLAP_CASES = [
    # (exit times, now, num_exits in window, flapping)
    ([], 0.0, 0, False),
    ([0.0, 1.0], 1.0, 2, False),
    ([0.0, 1.0, 2.0], 2.0, 3, True),
    ([0.0, 1.0, 2.0], 10.0, 2, False),   # 0.0 fell out of (0, 10]
    ([0.0, 1.0, 2.0], 12.0, 0, False),
    ([0.0, 5.0, 9.9], 9.9, 3, True),
]


@pytest.mark.parametrize("times,now,num_exits,flapping", FLAP_CASES)
def test_flap_detector(times, now, num_exits, flapping):
    detector = FlapDetector(window_s=10.0, max_exits=3)
    for t in times:
        detector.record_exit(t)
    assert detector.num_exits(now) == num_exits
    assert detector.is_flapping(now) is flapping


def test_flap_detector_record_reports_and_clear_forgets():
    detector = FlapDetector(window_s=10.0, max_exits=2)
    assert detector.record_exit(0.0) is False
    assert detector.record_exit(5.0) is True
    detector.clear()
    assert detector.num_exits(5.0) == 0
    assert detector.record_exit(6.0) is False


@pytest.mark.parametrize("window_s,max_exits", [(0.0, 3), (-1.0, 3), (10.0, 0)])
def test_flap_detector_invalid(window_s, max_exits):
    with pytest.raises(ValueError):
        FlapDetector(window_s, max_exits)


def test_fatal_exit_code_gives_up_at_once_other_codes_do_not():
    policy = RestartPolicy(**BASE, fatal_exit_codes={4: "configuration error"})
    policy.record_start("e0", 0.0)
    policy.record_exit("e0", 1.0, exit_code=4, reason="exit code 4")
    action = policy.decide("e0", 100.0)  # however long after: never a restart
    assert isinstance(action, GiveUp)
    assert action.reason.startswith("configuration error (exit code 4); not restarted")
    assert "planaria restart" in action.reason
    # an operator's restart that then crashes ordinarily is back to the usual backoff
    policy.record_start("e0", 200.0)
    policy.record_exit("e0", 201.0, exit_code=1, reason="exit code 1")
    assert policy.decide("e0", 201.0) == RestartAt(203.0)  # second failure in a row: 2 s
    # without the mapping, exit code 4 is an ordinary failure
    plain = RestartPolicy(**BASE)
    plain.record_start("e0", 0.0)
    plain.record_exit("e0", 1.0, exit_code=4)
    assert plain.decide("e0", 1.5) == RestartAt(2.0)
