"""The compiled decode forward (EngineConfig.compile, engine/compiled.py): compiled at
start-up, taken by every decode-only step without compiling again, and close to the eager
forward (float32: to rounding; bfloat16: the same top token, logprobs close)."""

from __future__ import annotations

import pytest
import torch

from planaria.engine import LLM, SamplingParams
from planaria.kernels import cpu_ext


def _decode_logprobs(llm, prompts):
    """One decode step of all prompts, eager then compiled, from the same KV cache."""
    from planaria.engine.messages import EngineCoreRequest
    from planaria.kernels.attention import build_metadata

    core, runner = llm.core, llm.core.runner
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(request_id=f"x{i}", prompt_token_ids=p, sampling_params=sp))
    core.step()  # the prefills and the first tokens
    sched = core.scheduler.schedule()  # the decode step: blocks allocated
    ss = sched.scheduled
    assert len(ss) == len(prompts) and all(s.decode for s in ss)
    out = []
    for fn in (runner.model, runner.compiled):
        # as ModelRunner.execute: the metadata outside inference mode (guards see dispatch keys)
        md = build_metadata([s.block_ids for s in ss], [s.start_pos + 1 for s in ss], [], runner.block_size,
                            runner.device)
        with torch.inference_mode():
            hidden = fn(torch.tensor([s.req.all_token_ids[s.start_pos] for s in ss]),
                        torch.tensor([s.start_pos for s in ss]), runner.kv_caches, md)
            out.append(torch.log_softmax(runner.model.compute_logits(hidden), dim=-1))
    core.scheduler.update_from_output(sched, out[0].argmax(-1).tolist())
    while core.has_unfinished_requests():
        core.step()
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_decode_close_to_eager_and_never_recompiles(tiny_moe, dtype):
    from torch._dynamo.utils import counters

    cpu_ext.build()
    llm = LLM(tiny_moe, dtype=dtype, max_num_seqs=8, kv_cache_bytes=2**24, compile=True)
    runner = llm.core.runner
    assert runner.compiled is not None and runner.compile_status.startswith("on (compiled in")
    graphs = counters["stats"]["unique_graphs"]

    prompts = [[(7 * i + j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(6)]  # contexts 5..50
    eager, compiled = _decode_logprobs(llm, prompts)
    if dtype == "float32":
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    else:  # in the manner of vLLM's check_logprobs_close
        assert (compiled.argmax(-1) == eager.argmax(-1)).float().mean() >= 5 / 6
        top = eager.argmax(-1, keepdim=True)
        assert (compiled.gather(1, top) - eager.gather(1, top)).abs().max() < 0.1

    calls = []
    inner = runner.compiled

    def counting(*args):
        calls.append(args[0].shape[0])
        return inner(*args)

    runner.compiled = counting
    from planaria.engine.models import packing

    packing.repack(runner.model)  # as a weight swap does: new packed tensors, the same graphs
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert calls and max(calls) == len(prompts) and min(calls) >= 1  # every decode-only step
    # batch sizes 1..8 and block tables 1..5 blocks wide, and nothing compiled after start-up
    assert counters["stats"]["unique_graphs"] == graphs


def test_compile_off_where_it_cannot_run(tiny_moe, monkeypatch):
    from planaria.engine.compiled import compilable

    llm = LLM(tiny_moe, max_num_seqs=4, kv_cache_bytes=2**24, batch_invariant=False)
    model = llm.core.runner.model
    assert llm.core.runner.compile_status == "off" and llm.core.runner.compiled is None
    assert compilable(model) is None
    assert "expert parallelism" in compilable(model, expert_parallel=True)
    monkeypatch.setattr(cpu_ext, "enabled", False)
    assert "C++ CPU kernels" in compilable(model)
    runner = llm.core.runner
    runner.compile_decode()
    assert runner.compiled is None and runner.compile_status.startswith("off: the C++ CPU kernels")
