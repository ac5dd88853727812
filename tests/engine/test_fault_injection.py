"""engine/fault_injection.py: the faults wrapped around a runner's execute, with a fake
runner (the whole StepRunner interface: execute). The real engine's side: test_iteration_details
(a fatal fault), test_one_request (poison), tests/integration/test_chaos.py and test_mttr.py."""

from __future__ import annotations

import pytest

from planaria.engine.errors import RequestExecutionError
from planaria.engine.fault_injection import POISON_EXIT_CODE, FaultInjectingRunner, poisoned_request
from planaria.engine.request import Request
from planaria.engine.sampling_params import SamplingParams
from planaria.engine.scheduler import ScheduledRequest, SchedulerOutput


class FakeRunner:
    def __init__(self) -> None:
        self.executed: list[SchedulerOutput] = []

    def execute(self, sched: SchedulerOutput):
        self.executed.append(sched)
        return "result"


def _sr(rid: str, prompt: list[int], start: int = 0) -> ScheduledRequest:
    req = Request(rid, prompt, SamplingParams(max_tokens=4), None, 4)
    return ScheduledRequest(req, len(prompt) - start, start, [0], samples=True)


def _batch(*srs: ScheduledRequest) -> SchedulerOutput:
    return SchedulerOutput(scheduled=list(srs))


def test_unarmed_it_runs_the_step():
    runner = FakeRunner()
    faults = FaultInjectingRunner(runner)
    sched = _batch(_sr("a", [1, 2]))
    assert faults.execute(sched) == "result" and runner.executed == [sched]


def test_fatal_raises_before_the_forward_once():
    runner = FakeRunner()
    faults = FaultInjectingRunner(runner)
    faults.inject_next_step("fatal")
    with pytest.raises(RuntimeError, match="injected fatal fault"):
        faults.execute(_batch(_sr("a", [1, 2])))
    assert runner.executed == []
    assert faults.execute(_batch(_sr("a", [1, 2]))) == "result"  # one step, then disarmed


def test_request_fault_runs_the_step_then_fails_its_first_request():
    runner = FakeRunner()
    faults = FaultInjectingRunner(runner)
    faults.inject_next_step("request")
    with pytest.raises(RequestExecutionError) as exc:
        faults.execute(_batch(_sr("a", [1, 2]), _sr("b", [3, 4])))
    assert exc.value.request_ids == ["a"] and not exc.value.request_fault
    assert len(runner.executed) == 1  # the forward ran: expert-parallel peers stay in step
    assert faults.execute(_batch(_sr("a", [1, 2]))) == "result"


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="fault kind"):
        FaultInjectingRunner(FakeRunner()).inject_next_step("hang")


# (case, scheduled as (id, prompt, start_pos), poison, the poisoned request)
POISON = [
    ("in the first chunk", [("a", [1, 7, 8, 2], 0)], (7, 8), "a"),
    ("not in a row", [("a", [7, 1, 8], 0)], (7, 8), None),
    ("a later chunk is not a first step", [("a", [7, 8, 1, 2], 2)], (7, 8), None),
    ("at the end of the prompt", [("a", [1, 2], 0), ("b", [3, 7, 8], 0)], (7, 8), "b"),
    ("the first of two", [("a", [7, 8], 0), ("b", [7, 8], 0)], (7, 8), "a"),
    ("longer than the prompt", [("a", [7], 0)], (7, 8), None),
]


@pytest.mark.parametrize("scheduled, poison, want", [c[1:] for c in POISON], ids=[c[0] for c in POISON])
def test_poisoned_request(scheduled, poison, want):
    assert poisoned_request([_sr(rid, ids, start) for rid, ids, start in scheduled], poison) == want


def test_poison_ends_the_process_before_the_forward(monkeypatch):
    exits = []

    def fake_exit(code):
        exits.append(code)
        raise SystemExit(code)  # os._exit never returns

    monkeypatch.setattr("planaria.engine.fault_injection.os._exit", fake_exit)
    runner = FakeRunner()
    faults = FaultInjectingRunner(runner, poison_tokens=(7, 8))
    assert faults.execute(_batch(_sr("a", [1, 2]))) == "result"
    with pytest.raises(SystemExit):
        faults.execute(_batch(_sr("b", [1, 7, 8])))
    assert exits == [POISON_EXIT_CODE] and len(runner.executed) == 1
