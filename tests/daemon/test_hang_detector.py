"""Hang detector: table-driven over heartbeat sequences, fake clock."""

from __future__ import annotations

import pytest

from planaria.daemon.hang_detector import HangDetector, Heartbeat

TIMEOUT_S = 10.0

CASES = [
    # (id, heartbeats as (step_counter, has_work, timestamp), check at, hung?)
    ("no heartbeats", [], 100.0, False),
    ("idle forever is not hung", [(0, False, float(t)) for t in range(0, 1000, 5)], 1000.0, False),
    ("idle, then silent under the silence timeout", [(0, False, 0.0)], 19.9, False),
    ("idle, then silent: frozen", [(0, False, 0.0)], 20.0, True),
    ("silence counts from the last heartbeat, not the last step",
     [(4, False, 0.0), (4, False, 15.0)], 30.0, False),
    ("idle with a frozen counter is not hung", [(5, False, t) for t in range(0, 60, 5)],
     60.0, False),
    ("busy and stepping", [(i, True, float(i)) for i in range(30)], 35.0, False),
    ("busy without steps, under timeout", [(3, True, 0.0), (3, True, 5.0)], 9.9, False),
    ("busy without steps, at timeout", [(3, True, 0.0), (3, True, 5.0)], 10.0, True),
    ("busy, then heartbeats stop", [(1, True, 0.0), (2, True, 1.0)], 11.0, True),
    ("work arrived after idle restarts the clock",
     [(3, False, 0.0), (3, False, 50.0), (3, True, 55.0)], 64.0, False),
    ("work arrived after idle, then stuck",
     [(3, False, 0.0), (3, True, 55.0), (3, True, 60.0)], 65.0, True),
    ("went idle again", [(3, True, 0.0), (3, True, 20.0), (3, False, 21.0)], 40.0, False),
    ("counter reset counts as progress", [(90, True, 0.0), (0, True, 8.0)], 15.0, False),
    ("stale heartbeat ignored",
     [(1, True, 0.0), (2, True, 5.0), (9, True, 4.0)], 15.0, True),
    ("progress then stall", [(1, True, 0.0), (2, True, 3.0), (2, True, 12.0)], 13.0, True),
]


@pytest.mark.parametrize("beats,now,hung", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check(beats, now, hung):
    detector = HangDetector(TIMEOUT_S)
    for step_counter, has_work, timestamp in beats:
        detector.observe("e0", step_counter, has_work, timestamp)
    assert detector.check(now) == (["e0"] if hung else [])


def test_several_engines_only_the_hung_one_is_reported():
    detector = HangDetector(TIMEOUT_S)
    for t in range(0, 31, 5):
        detector.observe(0, t, True, float(t))       # stepping
        detector.observe(1, 7, True, float(t))       # stuck with work
        detector.observe(2, 7, False, float(t))      # idle
    assert detector.check(30.0) == [1]
    assert detector.stalled_s(1, 30.0) == 30.0
    assert detector.stalled_s(2, 30.0) == 0.0
    assert detector.last_heartbeat(1) == Heartbeat(7, True, 30.0)
    detector.forget(1)
    assert detector.check(30.0) == []
    assert detector.last_heartbeat(1) is None


@pytest.mark.parametrize("timeout_s", [0.0, -1.0])
def test_invalid_timeout(timeout_s):
    with pytest.raises(ValueError):
        HangDetector(timeout_s)
    with pytest.raises(ValueError, match="silence_timeout_s"):
        HangDetector(10.0, silence_timeout_s=5.0)


def test_why_hung_names_the_rule():
    detector = HangDetector(TIMEOUT_S, silence_timeout_s=30.0)
    detector.observe("busy", 3, True, 0.0)
    detector.observe("idle", 3, False, 0.0)
    assert detector.why_hung("busy", 9.0) is None
    assert detector.why_hung("busy", 10.0).startswith("hung: work queued and no step progress")
    assert detector.why_hung("idle", 29.0) is None
    assert detector.why_hung("idle", 30.0).startswith("frozen: no heartbeat for 30.0s")
    assert detector.why_hung("unknown", 99.0) is None
    detector.hang_timeout_s = 20.0  # a reload: the explicit silence limit stays
    assert detector.silence_timeout_s == 30.0
    assert HangDetector(4.0).silence_timeout_s == 8.0
