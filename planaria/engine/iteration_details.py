"""Per-step records for diagnosis, and the scheduler dump logged when a step fails.

``IterationRecorder`` (on when ``EngineConfig.iteration_details``) keeps one
``IterationDetails`` per executed step until the engine process takes them and sends them
with the outputs (``EngineCoreOutputs.iteration_details``); the frontend's /metrics
exports them. ``scheduler_dump`` is a compact, JSON-able picture of the scheduler: what
ran, what waited, the budgets and the KV usage. Pure Python.
"""

from __future__ import annotations

from planaria.engine.messages import IterationDetails

MAX_KEPT = 1024  # records kept when nobody takes them (offline use): the newest win
MAX_DUMPED_REQUESTS = 32


class IterationRecorder:
    def __init__(self) -> None:
        self._records: list[IterationDetails] = []
        self._last_preemptions = 0

    def record(self, step_index: int, sched, step_s: float, scheduler) -> IterationDetails:
        preemptions = scheduler.num_preemptions
        rec = IterationDetails(
            step_index=step_index,
            request_ids=[sr.req.request_id for sr in sched.scheduled],
            num_scheduled_tokens=[sr.num_tokens for sr in sched.scheduled],
            step_s=round(step_s, 6), kv_usage=round(scheduler.kv.usage, 4),
            num_preemptions=preemptions - self._last_preemptions,
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting)
        self._last_preemptions = preemptions
        self._records.append(rec)
        if len(self._records) > MAX_KEPT:
            del self._records[: len(self._records) - MAX_KEPT]
        return rec

    def take(self) -> list[IterationDetails]:
        out, self._records = self._records, []
        return out


def _request_line(req, kv) -> dict:
    return {"id": req.request_id, "status": req.status.value, "prompt": req.num_prompt_tokens,
            "out": req.num_output_tokens, "computed": req.num_computed_tokens,
            "preemptions": req.num_preemptions, "in_flight": req.in_flight,
            "blocks": len(kv.get_block_ids(req.request_id))}


def scheduler_dump(scheduler, sched=None) -> dict:
    """Running and waiting requests (the first MAX_DUMPED_REQUESTS of each), budgets, KV."""
    running = list(scheduler.running)
    waiting = list(scheduler.waiting)
    dump = {
        "num_running": len(running), "num_waiting": len(waiting),
        "num_requests": len(scheduler.requests),
        "max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_model_len": scheduler.max_model_len, "num_preemptions": scheduler.num_preemptions,
        "kv_usage": round(scheduler.kv.usage, 4),
        "running": [_request_line(r, scheduler.kv) for r in running[:MAX_DUMPED_REQUESTS]],
        "waiting": [_request_line(r, scheduler.kv) for r in waiting[:MAX_DUMPED_REQUESTS]],
    }
    if sched is not None:
        dump["step"] = {"num_batched_tokens": sched.num_batched_tokens,
                        "scheduled": [(sr.req.request_id, sr.start_pos, sr.num_tokens, sr.samples)
                                      for sr in sched.scheduled[:MAX_DUMPED_REQUESTS]],
                        "preempted": sched.preempted_req_ids[:MAX_DUMPED_REQUESTS]}
    return dump
