"""A group switch that fails without any process dying is aborted, for real: real etcd,
real EP engine processes, the real leader controller, a closed-loop streaming load.

The joining rank SIGSTOPs itself right after it arrived at the new epoch (fault injection),
so the old ranks commit and their new group cannot form. They go UNHEALTHY with their
requests kept and report the failed epoch; the leader aborts: the op becomes FAILED with
the reason, ``desired`` goes back to 2 and the next epoch re-forms the old membership. No
rank dies for it, a later ``scale`` is not blocked, and every request completes with the
text of a fault-free run. The engines' leases are long here (60 s), so the stopped joiner
stays "live" in etcd and only the abort path can get serving going again.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from bench.closed_loop import ClosedLoopLoad, mismatches
from bench.streaming_load import request_bodies
from planaria.elastic.keys import OpPhase
from planaria.elastic.ep_proc import EP_FAULT_ENV
from planaria.engine.envs import FAULT_INJECTION
from tests.elastic._deployment import EPDeployment

pytestmark = pytest.mark.timeout(600)


def _reference(model: str, bodies: list[dict]) -> list[str]:
    from planaria.engine import LLM, SamplingParams

    llm = LLM(model, kv_cache_bytes=32 * 2**20, max_model_len=1024)
    out = []
    for b in bodies:
        sp = SamplingParams(temperature=b["temperature"], top_p=b.get("top_p", 1.0), seed=b.get("seed"),
                            max_tokens=b["max_tokens"], ignore_eos=True)
        out.append(llm.generate([b["prompt"]], sp)[0].text)
    return out


def _final_op(d: EPDeployment, op_id: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        op = d.node.controller.desired.get_op(op_id)
        if op is not None and op.phase.is_final:
            return op
        time.sleep(0.1)
    raise AssertionError(f"op {op_id} not final within {timeout_s} s: {op}; {d.node.controller.last_action}")


def _stopped(pid: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
            return True
        time.sleep(0.05)
    return False


def _failing_scale_up(d: EPDeployment, before: set[str]) -> tuple[str, object, object]:
    """scale 2 -> 3 with a joiner that stops after arriving; returns (joiner, op, epoch)."""
    ep = d.epoch()
    d.launcher.env = dict(os.environ, **{FAULT_INJECTION: "1", EP_FAULT_ENV: "stop_after_arrive"})
    op_id = d.scale(3)
    op = _final_op(d, op_id)
    d.launcher.env = None
    joiner = next(e for e in d.launcher.procs if e not in before)
    assert _stopped(d.launcher.procs[joiner].pid)
    assert op.phase == OpPhase.FAILED, op
    assert "failed to switch" in op.error and joiner in op.error, op.error  # the reason, and who was left out
    after, _ = d.wait_serving(2, newer_than=ep.number, timeout_s=60)
    assert after.ranks == ep.ranks  # re-formed at the old membership
    desired, _ = d.node.controller.desired.read_desired()
    assert desired.num_engines == 2 and desired.op_id == op_id  # rolled back with the op
    return joiner, op, after


@pytest.mark.slow  # make test-all (the default suite stays within CI's time; see README)
def test_failed_switch_is_aborted_and_the_old_ranks_keep_serving(tmp_path, tiny_moe):
    bodies = request_bodies(12, (16, 40), seed=5)
    reference = _reference(tiny_moe, bodies)
    d = EPDeployment(tmp_path, tiny_moe, num_engines=2, engine_lease_ttl_s=60.0, collective_timeout_s=3.0,
                     switch_timeout_s=20.0)
    try:
        d.start(timeout_s=240)
        ep0 = d.epoch()
        first = {e: d.launcher.procs[e].pid for e in ep0.ranks}
        load = ClosedLoopLoad(d.base_url, bodies, num_streams=4).start()
        load.wait_done(2)

        # 1. The joiner hangs mid-switch and is then killed.
        j1, op1, ep1 = _failing_scale_up(d, set(first))
        failed1 = ep1.number - 1  # the aborted epoch
        records = {r.engine_id: r for r in d.node.membership.list_engines()}
        for e in ep0.ranks:  # the old ranks tried, failed, reported, and were re-formed
            assert records[e].failed_epoch == failed1 and records[e].state == "serving"
        os.kill(d.launcher.procs[j1].pid, signal.SIGKILL)

        # 2. Again (the failed op does not block a new one); this time the joiner goes on.
        j2, _op2, ep2 = _failing_scale_up(d, set(first) | {j1})
        os.kill(d.launcher.procs[j2].pid, signal.SIGCONT)
        time.sleep(1.0)
        assert d.epoch().number == ep2.number  # a woken joiner changes nothing by itself
        op3 = d.scale(3)
        ep3, _ = d.wait_serving(3, newer_than=ep2.number, timeout_s=120)
        assert ep3.ranks == [*ep0.ranks, j2]
        assert d.node.controller.desired.get_op(op3).phase == OpPhase.DONE
        assert {r.engine_id: r for r in d.node.membership.list_engines()}[j2].kv_source == "reused"
        load.wait_done(load.num_done + 4)

        records = load.stop()
        assert not mismatches(records, reference), mismatches(records, reference)[:3]
        # No rank died for the failed switches: the first ranks are the same live processes.
        assert {e: d.launcher.procs[e].pid for e in ep0.ranks} == first
        assert all(d.launcher.procs[e].poll() is None for e in ep0.ranks)
        assert [e for e, _t in d.deaths] == [j1]
    finally:
        d.close()
