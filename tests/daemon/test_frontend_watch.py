"""FrontendWatch: when a frontend whose event loop stopped answering counts as hung
(injected clock, no processes)."""

from __future__ import annotations

import pytest

from planaria.daemon.frontend_watch import FrontendWatch

HANG_S, START_S = 10.0, 120.0
PID = 41

# (what, events, now, expected reason prefix or None). Events: ("start", t) starts
# process PID at t; ("beat", t) or ("beat", t, pid) is an answer received at t.
CASES = [
    ("start-up is not judged by the hang timeout", [("start", 0)], 119.9, None),
    ("never answered within the start grace", [("start", 0)], 120.0,
     "frontend hung: event loop never answered in 120.0 s since its start (limit 120 s)"),
    ("a slow start then answers: the hang timeout runs from the answer", [("start", 0), ("beat", 100)],
     109.9, None),
    ("answered once, then silent for the limit", [("start", 0), ("beat", 1)], 11.0,
     "frontend hung: event loop did not answer for 10.0 s (limit 10 s)"),
    ("answering regularly", [("start", 0)] + [("beat", t) for t in range(1, 60, 2)], 68.9, None),
    ("answers stop", [("start", 0)] + [("beat", t) for t in range(1, 60, 2)], 69.0,
     "frontend hung: event loop did not answer for 10.0 s"),
    ("an older frontend's answers do not count", [("start", 0), ("beat", 1), ("beat", 8, 40)],
     11.0, "frontend hung: event loop did not answer for 10.0 s"),
    ("a restart gets a fresh start grace", [("start", 0), ("beat", 1), ("start", 50)], 60.0, None),
    ("an answer received late (out of order) does not move time back",
     [("start", 0), ("beat", 5), ("beat", 3)], 15.0, "frontend hung: event loop did not answer for 10.0 s"),
    ("nothing started: nothing to judge", [], 1000.0, None),
]


def run(events, hang_s=HANG_S):
    watch = FrontendWatch(hang_s, START_S)
    for event in events:
        if event[0] == "start":
            watch.start(PID, event[1])
        else:
            watch.answered(event[2] if len(event) > 2 else PID, event[1])
    return watch


@pytest.mark.parametrize("what, events, now, expected", CASES, ids=[c[0] for c in CASES])
def test_why_hung(what, events, now, expected):
    why = run(events).why_hung(now)
    if expected is None:
        assert why is None
    else:
        assert why is not None and why.startswith(expected), why


def test_deadline_is_when_it_would_become_hung():
    watch = run([("start", 0)])
    assert watch.deadline() == START_S
    watch.answered(PID, 3.0)
    assert watch.deadline() == 13.0
    assert watch.why_hung(12.99) is None and watch.why_hung(13.0) is not None
    watch.forget()
    assert watch.deadline() is None and watch.why_hung(1e9) is None


def test_off_at_zero_but_answers_still_counted_for_status():
    watch = run([("start", 0), ("beat", 1)], hang_s=0)
    assert watch.why_hung(1e6) is None and watch.deadline() is None
    watch.answered(PID, 2.0, lag_s=0.25)
    assert watch.status(2.5) == {"last_answer_age_s": 0.5, "num_answers": 2, "loop_lag_s": 0.25,
                                 "hang_timeout_s": 0.0}


def test_reconfigure_applies_to_the_running_frontend():
    watch = run([("start", 0), ("beat", 1)])
    assert watch.why_hung(5.0) is None
    watch.reconfigure(3.0, START_S)
    assert watch.why_hung(5.0).startswith("frontend hung: event loop did not answer for 4.0 s (limit 3 s)")
    with pytest.raises(ValueError):
        watch.reconfigure(-1.0, START_S)
    with pytest.raises(ValueError):
        FrontendWatch(HANG_S, 0.0)


def test_status_before_any_answer():
    watch = run([("start", 0)])
    assert watch.status(5.0) == {"last_answer_age_s": None, "num_answers": 0, "loop_lag_s": None,
                                 "hang_timeout_s": HANG_S}
    assert watch.answered(PID + 1, 1.0) is False  # not the current frontend
