"""A short fault storm with the daemon's default restart policy (bench/chaos_soak.py runs
it for 5 minutes in both modes): random SIGKILL / SIGSTOP of a serving engine every 2-5 s
under streaming load. Engines killed after serving come back at once instead of backing
off into a flap hold, so no request fails and every text equals the fault-free pass."""

from __future__ import annotations

import argparse

import pytest

from bench.chaos_soak import report, run_mode

pytestmark = pytest.mark.timeout(400)


def test_a_short_fault_storm_in_replica_mode_fails_no_request(tiny_moe, tmp_path):
    args = argparse.Namespace(duration_s=25.0, baseline_s=10.0, streams=6, num_bodies=12, seed=3,
                              model=tiny_moe)
    r = run_mode("replica", tmp_path, args)
    print("\n".join(report(r)))
    kinds = [k for _, k, _ in r.faults]
    assert len(kinds) >= 4 and r.restarts >= kinds.count("kill") + kinds.count("stop") - 2
    assert not r.storm.failed and not r.storm.mismatched, report(r)
    assert r.storm.done >= 20
    # both engines down at once happens (a fault every 2-5 s, a restart takes seconds):
    # requests wait for one then (none fails); the share is reported, not a target. It
    # follows the host's restart time: 0.46-0.5 on a 2-vCPU EPYC VM (twice in clean runs,
    # 12-13 s of 26-28 with none serving), more on faster hosts. The bound only catches
    # engines left down (a flap hold would also show as fewer restarts than faults above)
    assert r.serving_share > 0.3, report(r)
