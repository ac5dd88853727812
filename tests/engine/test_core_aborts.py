"""Aborts that arrive while a batch is in flight (EngineCore.queue_aborts): applied between
the forward and its output update, so the aborted request gets no token from that step and
its blocks are freed at once. Real EngineCore on the tiny-moe demo model."""

from __future__ import annotations

import threading

import pytest

from planaria.engine.config import EngineConfig
from planaria.engine.core import EngineCore
from planaria.engine.messages import EngineCoreRequest
from planaria.engine.sampling_params import SamplingParams


def _req(rid: str, n: int = 40, base: int = 100, max_tokens: int = 50) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[base + i for i in range(n)],
                             sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                            ignore_eos=True))


def _core(model: str, **kw) -> EngineCore:
    cfg = dict(model=model, kv_cache_bytes=8 * 2**20, max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=256, num_threads=1)
    cfg.update(kw)
    return EngineCore(EngineConfig(**cfg))


def _abort_during_forward(core: EngineCore, request_ids: list[str]) -> list:
    """Make the runner's next execute() queue an abort from another thread while the real
    forward is running (the engine process's input thread does the same)."""
    real = core.runner.execute
    seen = []

    def execute(sched):
        t = threading.Thread(target=core.queue_aborts, args=(request_ids,))
        t.start()
        t.join()
        seen.append([sr.req.request_id for sr in sched.scheduled])
        return real(sched)

    core.runner.execute = execute
    return seen


@pytest.fixture(scope="module")
def model(tiny_moe):
    return tiny_moe


def test_abort_during_forward_yields_no_token_and_frees_blocks(model):
    core = _core(model)
    core.add_request(_req("a", base=100))
    core.add_request(_req("b", base=300))
    outs, _ = core.step()  # prefill both: one token each
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    blocks_a = list(core.kv.get_block_ids("a"))
    free_before = core.kv.pool.num_free_blocks
    seen = _abort_during_forward(core, ["a"])
    outs, executed = core.step()
    assert executed and seen == [["a", "b"]]  # "a" was in the batch when the abort came
    by_id = {}
    for o in outs:
        by_id.setdefault(o.request_id, []).append(o)
    assert [(o.finish_reason, o.new_token_ids) for o in by_id["a"]] == [("abort", [])]
    assert len(by_id["b"]) == 1 and len(by_id["b"][0].new_token_ids) == 1
    assert "a" not in core.scheduler.requests and core.kv.get_block_ids("a") == []
    assert core.kv.pool.num_free_blocks == free_before + len(blocks_a)
    assert all(core.kv.pool.ref_cnt[b] == 0 for b in blocks_a)
    del core.runner.execute  # back to the class method
    while core.has_unfinished_requests():  # "b" goes on to its full length
        outs, _ = core.step()
        assert all(o.request_id == "b" for o in outs)
    assert core.kv.pool.num_free_blocks == core.num_kv_blocks


def test_abort_while_batch_queued_in_executor(model):
    core = _core(model, max_concurrent_batches=2)
    try:
        core.add_request(_req("a", base=100))
        core.add_request(_req("b", base=300))
        outs, executed = core.step_with_batch_queue()  # submits the prefill, does not wait
        assert executed and not outs and len(core.batch_queue) == 1
        core.queue_aborts(["a"])  # the batch is in flight: its output is not applied yet
        got: dict[str, list] = {"a": [], "b": []}
        while core.has_unfinished_requests() or core.batch_queue:
            outs, _ = core.step_with_batch_queue()
            for o in outs or []:
                got[o.request_id].append(o)
        assert [(o.finish_reason, o.new_token_ids) for o in got["a"]] == [("abort", [])]
        assert sum(len(o.new_token_ids) for o in got["b"]) == 50
        assert core.kv.pool.num_free_blocks == core.num_kv_blocks
    finally:
        core.shutdown()


def test_queued_abort_never_hits_a_later_request_with_the_same_id(model):
    core = _core(model)
    core.add_request(_req("x", max_tokens=3))
    core.step()
    core.queue_aborts(["x"])  # queued (as by the input thread) ...
    core.abort_requests(["x"])  # ... and applied by the ordered path first
    outs, _ = core.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("x", "abort")]
    core.add_request(_req("x", max_tokens=3, base=500))  # the id is reused
    core.queue_aborts(["never-added"])
    tokens = []
    while core.has_unfinished_requests():
        outs, _ = core.step()
        for o in outs:
            tokens.extend(o.new_token_ids)
            last = o
    assert len(tokens) == 3 and last.finish_reason == "length"
