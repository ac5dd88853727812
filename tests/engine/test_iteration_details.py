"""Per-step records (EngineConfig.iteration_details): recorded, sent, exported; the
scheduler dump logged when a step fails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from planaria.engine.config import EngineConfig
from planaria.engine.core import EngineCore
from planaria.engine.messages import EngineCoreOutputs, EngineCoreRequest, IterationDetails
from planaria.engine.sampling_params import SamplingParams


def _req(rid: str, n: int = 24, max_tokens: int = 8, start: int = 3) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(start, start + n)),
                             sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def _core(model: str, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=model, max_model_len=256, iteration_details=True, **kw))


def test_off_by_default(tiny_moe):
    core = EngineCore(EngineConfig(model=tiny_moe, num_kv_blocks=32, max_model_len=256))
    core.add_request(_req("a"))
    core.step()
    assert core.take_iteration_details() is None


def test_every_step_is_recorded(tiny_moe):
    core = _core(tiny_moe, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4)
    for i in range(3):
        core.add_request(_req(f"r{i}", n=40, start=3 + 100 * i))  # distinct: no prefix-cache hits
    num_steps = 0
    while core.has_unfinished_requests():
        _, executed = core.step()
        num_steps += executed
    recs = core.take_iteration_details()
    assert [r.step_index for r in recs] == list(range(num_steps))
    first = recs[0]
    assert first.request_ids == ["r0", "r1"] and first.num_scheduled_tokens == [40, 24]  # chunked
    assert all(0.0 <= r.kv_usage <= 1.0 and r.step_s > 0 for r in recs)
    assert sum(sum(r.num_scheduled_tokens) for r in recs) == 3 * 40 + 3 * 7
    assert core.take_iteration_details() == []


def test_preemptions_are_counted_per_step(tiny_moe):
    core = _core(tiny_moe, num_kv_blocks=6, block_size=16, max_num_seqs=4)
    for i in range(3):
        core.add_request(_req(f"p{i}", n=30, max_tokens=20))
    while core.has_unfinished_requests():
        core.step()
    recs = core.take_iteration_details()
    assert core.scheduler.num_preemptions > 0
    assert sum(r.num_preemptions for r in recs) == core.scheduler.num_preemptions


def test_records_travel_on_the_wire():
    from planaria.engine.wire import MsgType, WireDecoder, WireEncoder

    outs = EngineCoreOutputs(engine_index=1, iteration_details=[IterationDetails(
        step_index=7, request_ids=["a", "b"], num_scheduled_tokens=[1, 16], step_s=0.002, kv_usage=0.5,
        num_preemptions=1, num_running=2, num_waiting=3)])
    frames = WireEncoder().encode(MsgType.OUTPUTS, outs)
    _, back = WireDecoder(frozenset({MsgType.OUTPUTS})).decode([bytes(f) for f in frames])
    assert back.iteration_details == outs.iteration_details


def test_engine_process_publishes_records(tiny_moe):
    from planaria.engine.proc import EngineCoreProc

    proc = EngineCoreProc(0, ["ipc:///nonexistent"], None)
    proc.core = _core(tiny_moe, num_kv_blocks=32)
    proc._links = [SimpleNamespace(slot=0), SimpleNamespace(slot=1)]
    proc.core.add_request(_req("a"))
    proc._publish(proc.core.step()[0])
    sent = [proc.output_queue.get_nowait() for _ in range(proc.output_queue.qsize())]
    with_details = [(slot, msg) for slot, _, msg in sent if getattr(msg, "iteration_details", None)]
    assert [slot for slot, _ in with_details] == [0, 1]
    assert with_details[0][1].iteration_details[0].request_ids == ["a"]


def test_metrics_export():
    from planaria.frontend.metrics import FrontendMetrics

    m = FrontendMetrics("x")
    m.iterations.observe(0, [IterationDetails(step_index=i, request_ids=["a"], num_scheduled_tokens=[4],
                                              step_s=0.003, kv_usage=0.25, num_preemptions=i % 2)
                             for i in range(5)])
    text = m.render([])
    assert 'planaria_engine_steps_total{engine="0"} 5' in text
    assert 'planaria_engine_scheduled_tokens_total{engine="0"} 20' in text
    assert 'planaria_engine_step_preemptions_total{engine="0"} 2' in text
    assert "planaria_engine_step_seconds_count 5" in text
    assert 'planaria_engine_last_step_index{engine="0"} 4' in text
    assert "engine_steps_total" not in FrontendMetrics("y").render([])  # nothing until records come


def test_step_failure_logs_the_scheduler_state(tiny_moe, capsys):
    core = _core(tiny_moe, num_kv_blocks=32)
    core.add_request(_req("victim"))
    core.add_request(_req("bystander"))
    core.inject_step_fault("fatal")
    with pytest.raises(RuntimeError, match="injected"):
        core.step()
    out = capsys.readouterr().out
    assert "step failed; scheduler state" in out
    assert "victim" in out and "bystander" in out and "kv_usage" in out and "max_num_batched_tokens" in out
