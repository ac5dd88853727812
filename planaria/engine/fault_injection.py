"""Fault injection for chaos tests and bench/mttr.py, as a wrapper around a runner's
``execute``: the model runner has no fault branch, and an engine that no test asks for
faults runs its runner bare.

    FaultInjectingRunner(runner, poison_tokens)   EngineCore wraps its runner in one at start
                                                  when envs.POISON_TOKENS is set, else on its
                                                  first inject_step_fault
    .inject_next_step("fatal" | "request")        arms the next execute (one step, then disarmed)

What the wrapped ``execute`` does:

- "fatal": raises RuntimeError before the forward (an engine-level fault: engine/proc.py's
  fault handling takes over).
- "request": runs the step, the forward's collectives included, so expert-parallel peers
  stay in step; then drops its result and raises RequestExecutionError for the batch's first
  request (EngineCore fails it and rolls the others back, as for a real request fault).
- poison tokens (envs.POISON_TOKENS): a batch holding the first chunk of a prompt with the
  poison tokens in a row ends the process at once (os._exit(139), no death report), as a
  native crash in the forward would. The supervisor's flight record pins it on that request.
"""

from __future__ import annotations

import os
from typing import Protocol

import structlog

from planaria.engine.errors import RequestExecutionError
from planaria.engine.scheduler import ScheduledRequest, SchedulerOutput

log = structlog.get_logger("planaria.engine.faults")
FAULT_KINDS = ("fatal", "request")
POISON_EXIT_CODE = 139  # what a SIGSEGV'd process reports to a shell


class StepRunner(Protocol):
    """What EngineCore calls to run a scheduled batch: a ModelRunner, or this wrapper."""

    def execute(self, sched: SchedulerOutput):  # -> model_runner.StepResult
        ...


def poisoned_request(scheduled: list[ScheduledRequest], poison: tuple[int, ...]) -> str | None:
    """The id of the first request whose first chunk is scheduled here and whose prompt
    holds ``poison`` in a row, else None."""
    k = len(poison)
    for sr in scheduled:
        ids = sr.req.prompt_token_ids
        if sr.start_pos == 0 and any(tuple(ids[i:i + k]) == poison for i in range(len(ids) - k + 1)):
            return sr.req.request_id
    return None


class FaultInjectingRunner:
    """Wraps ``runner.execute`` with the faults above; a StepRunner itself."""

    def __init__(self, runner: StepRunner, poison_tokens: tuple[int, ...] = ()) -> None:
        self._runner = runner
        self._poison = poison_tokens
        self._next_step: str | None = None

    def inject_next_step(self, kind: str) -> None:
        """Arm the next ``execute`` with ``kind`` ("fatal" or "request"; see the module docstring)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
        self._next_step = kind

    def execute(self, sched: SchedulerOutput):
        fault, self._next_step = self._next_step, None
        if self._poison:
            rid = poisoned_request(sched.scheduled, self._poison)
            if rid is not None:
                log.error("fault injection: poison request; dying", request_id=rid)
                os._exit(POISON_EXIT_CODE)
        if fault == "fatal":
            raise RuntimeError("injected fatal fault")
        result = self._runner.execute(sched)
        if fault == "request" and sched.scheduled:  # after the forward: EP peers stay in step
            raise RequestExecutionError([sched.scheduled[0].req.request_id], "injected request fault")
        return result
