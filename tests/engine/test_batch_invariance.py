"""The batch-invariant mode (EngineConfig.batch_invariant) end to end, in bfloat16: one
prompt's tokens, logprobs and prompt logprobs are the same bits (==, not approx) alone and
inside batches of 1 to 64 mixed-length requests (greedy and seeded-random batch-mates,
ending at different steps), prefilled in one chunk or in chunks cut at other places
(a 128-token step budget), after a prefix-cache hit or not, and whether a position was
decoded or prefilled. With the mode off the same comparisons find differences
(``test_with_the_mode_off_batch_mates_change_the_logprobs``): the comparisons can fail."""

from __future__ import annotations

import random

import pytest
import torch

from planaria.engine import LLM, SamplingParams
from planaria.engine.config import EngineConfig
from planaria.engine.core import EngineCore
from planaria.engine.errors import EngineError
from planaria.kernels import cpu_ext
from planaria.kernels.linear import invariant_packs

BATCHES = [1, 2, 7, 16, 33, 64]
TARGET_LEN = 150  # over the step budget: prefilled in two or more chunks, cut by the batch
NUM_OUT = 12


@pytest.fixture(scope="module", autouse=True)
def built():
    cpu_ext.build()
    assert cpu_ext.available(), cpu_ext.status()


def _engine(model: str, invariant: bool = True) -> LLM:  # explicit: "auto" depends on the CPU
    return LLM(model, dtype="bfloat16", batch_invariant=invariant, max_num_seqs=64, max_num_batched_tokens=128,
               num_kv_blocks=1024)


def _target(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(TARGET_LEN)]


def _asked(prompt_logprobs: int | None = 2) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_OUT, ignore_eos=True, logprobs=3,
                          prompt_logprobs=prompt_logprobs)


def _record(out) -> tuple:
    assert out.finish_reason == "length", out.error
    prompt = None if out.prompt_logprobs is None else [tuple(e.token_ids) + tuple(e.logprobs) + (e.sampled_rank,)
                                                       for e in out.prompt_logprobs[1:]]
    return (out.token_ids, [tuple(e.token_ids) + tuple(e.logprobs) + (e.sampled_rank,) for e in out.logprobs],
            prompt)


def _in_batch(llm: LLM, target: list[int], params: SamplingParams, n: int, seed: int):
    """The target among n - 1 others (1 to 120 tokens, greedy or seeded random, 1 to 20
    tokens out) at a random place; returns its output and a plain greedy copy's tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 4000) for _ in range(rng.randrange(1, 120))] for _ in range(n - 1)]
    others = [SamplingParams(temperature=rng.choice([0, 0.8]), seed=rng.randrange(1000), top_k=50,
                             max_tokens=rng.randrange(1, 20), ignore_eos=True, logprobs=rng.choice([None, 2]))
              for _ in range(n - 1)]
    at = rng.randrange(n)
    prompts.insert(at, target)
    others.insert(at, params)
    outs = llm.generate(prompts, others)
    return outs[at]


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-qwen2"])  # MoE + q/k norm; dense + q/k/v bias
def test_a_prompt_gets_the_same_bits_alone_and_in_any_batch(demo_models, preset):
    llm = _engine(demo_models(preset))
    target = _target()
    alone = _record(llm.generate([target], _asked())[0])
    greedy = SamplingParams(temperature=0, max_tokens=NUM_OUT, ignore_eos=True)  # the lm_head's argmax path
    for n in BATCHES:
        llm.core.reset_prefix_cache()
        got = _record(_in_batch(llm, target, _asked(), n, seed=n))
        assert got == alone, f"batch of {n}"
        plain = _in_batch(llm, target, greedy, n, seed=100 + n)
        assert plain.token_ids == alone[0], f"plain greedy, batch of {n}"


def test_a_follow_up_takes_over_the_last_block_its_first_turn_left_with_the_same_bits(demo_models):
    """A conversation's next turn (prompt + reply + a new message) takes the first turn's
    last block, not full, over (kv_cache_manager: kept tails): it computes from the first
    position the first turn did not, and gets the bits of the same prompt on an empty cache."""
    llm = _engine(demo_models("tiny-moe"))
    llm.core.reset_prefix_cache()
    turn1 = _target(2)
    reply = llm.generate([turn1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    follow = turn1 + reply + _target(3)[:25]
    computed_by_turn1 = TARGET_LEN + 20 - 1  # the last sampled token was never fed
    assert computed_by_turn1 % 16, "the first turn must end inside a block"
    kept = llm.generate([follow], _asked(2))[0]
    assert kept.num_cached_tokens == 0  # prompt logprobs: no hit (every position must run)
    llm.core.reset_prefix_cache()
    llm.generate([turn1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    kept = llm.generate([follow], _asked(None))[0]
    assert kept.num_cached_tokens == computed_by_turn1
    llm.core.reset_prefix_cache()
    fresh = llm.generate([follow], _asked(None))[0]
    assert fresh.num_cached_tokens == 0
    assert _record(kept) == _record(fresh)


def test_prefix_cache_hits_and_decoded_positions_match(demo_models):
    llm = _engine(demo_models("tiny-moe"))
    target = _target(1)
    llm.core.reset_prefix_cache()
    first = llm.generate([target], _asked(None))[0]
    assert first.num_cached_tokens == 0
    ref = _record(first)
    again = llm.generate([target], _asked(None))[0]
    assert again.num_cached_tokens == TARGET_LEN // 16 * 16  # every full block a hit
    assert _record(again) == ref
    hit_in_batch = _in_batch(llm, target, _asked(None), 33, seed=5)
    assert hit_in_batch.num_cached_tokens > 0
    assert _record(hit_in_batch) == ref
    # the generated tokens as a prompt: their positions prefilled now, decoded before
    tokens = ref[0]
    extended = llm.generate([target + tokens[:-1]], _asked(3))[0]
    prefilled = _record(extended)[2][TARGET_LEN - 1:]  # entries for prompt positions TARGET_LEN ..
    assert len(prefilled) == NUM_OUT - 1
    for i, (decoded, pre) in enumerate(zip(ref[1], prefilled)):
        assert decoded == pre, f"generated token {i}: decoded {decoded} vs prefilled {pre}"
    assert _record(extended)[1][0] == ref[1][-1]  # and its first token decodes as the 12th did


def test_preemption_recomputes_the_same_bits(demo_models):
    target = _target(2)
    llm = _engine(demo_models("tiny-moe"))
    ref = _record(llm.generate([target], _asked())[0])
    # 40 blocks of 16 tokens cannot hold six 150-token prompts and their outputs
    small = LLM(demo_models("tiny-moe"), dtype="bfloat16", batch_invariant=True, max_num_seqs=6,
                max_num_batched_tokens=64, num_kv_blocks=40, enable_prefix_caching=False)
    outs = small.generate([_target(10 + i) for i in range(5)] + [target], [_asked()] * 6)
    assert small.core.scheduler.num_preemptions > 0
    assert _record(outs[-1]) == ref


def test_with_the_mode_off_batch_mates_change_the_logprobs(demo_models):
    llm = _engine(demo_models("tiny-moe"), invariant=False)
    target = _target()
    alone = _record(llm.generate([target], _asked())[0])
    differs = []
    for n in BATCHES[1:4]:
        llm.core.reset_prefix_cache()
        differs.append(_record(_in_batch(llm, target, _asked(), n, seed=n)) != alone)
    assert any(differs)  # what the tests above would have caught


def test_packed_for_its_kernel_and_a_weight_swap_repacks(demo_models, tmp_path):
    from planaria.engine.demo_model import build_demo_model

    other = str(build_demo_model(tmp_path / "b", "tiny-moe", seed=1, progress=lambda _: None))
    llm = _engine(demo_models("tiny-moe"))
    runner = llm.core.runner
    linears = [m for m in runner.model.modules() if getattr(m, "packed", None) is not None]
    if invariant_packs(torch.device("cpu"), torch.bfloat16):
        assert linears and all(m.packed.dim() == 4 for m in linears)  # pack_invariant's layout, not oneDNN's
        assert len(runner.model.lm_head_packed) == 1
        assert runner.packed_bytes >= sum(m.weight.numel() * 2 for m in linears)
    else:
        assert not linears and runner.packed_bytes == 0
    assert all(getattr(m, "packed_experts", None) is None for m in runner.model.modules())
    assert "batch-invariant" in llm.core.dtype_text  # shown by `planaria status`
    target = _target(3)
    want = _record(_engine(other).generate([target], _asked())[0])
    llm.core.load_weights(other, version="b")
    assert llm.core._weight_update.wait_read(60)
    assert _record(llm.generate([target], _asked())[0]) == want  # the packed copies follow the new weights


def test_the_mode_needs_the_cpp_kernels_and_runs_eager(demo_models, monkeypatch):
    model = demo_models("tiny-moe")
    core = EngineCore(EngineConfig(model=model, dtype="bfloat16", batch_invariant=True, compile=True,
                                   num_kv_blocks=64, max_model_len=256))
    assert core.runner.compiled is None and "batch-invariant" in core.runner.compile_status
    monkeypatch.setattr(cpu_ext, "enabled", False)
    with pytest.raises(EngineError, match="batch_invariant needs the C.. CPU kernels"):
        EngineCore(EngineConfig(model=model, dtype="bfloat16", batch_invariant=True, num_kv_blocks=64,
                                max_model_len=256))


BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("setting, env, flags, dtype, compile_, on, reason", [
    (None, {}, "avx512f avx512_bf16", BF16, False, True, "auto: AVX512-BF16, no AMX"),
    (None, {}, "avx512f avx512_bf16", FP32, False, True, "auto: AVX-512, no AMX"),
    (None, {}, "avx512f avx512_bf16 amx_bf16", BF16, False, False, "auto: AMX (oneDNN's AMX GEMM kept)"),
    (None, {}, "avx2 fma", FP32, False, False, "auto: no AVX-512 tile for torch.float32"),
    (None, {}, "avx512f", BF16, False, False, "auto: no AVX-512 tile for torch.bfloat16"),
    (None, {}, "avx512f avx512_bf16", BF16, True, False, "auto: a compiled forward was asked for"),
    (None, {"PLANARIA_BATCH_INVARIANT": "0"}, "avx512f avx512_bf16", BF16, False, False, "PLANARIA_BATCH_INVARIANT"),
    (None, {"PLANARIA_BATCH_INVARIANT": "1"}, "avx2 fma", FP32, False, True, "PLANARIA_BATCH_INVARIANT"),
    (True, {"PLANARIA_BATCH_INVARIANT": "0"}, "avx2 fma", FP32, True, True, "config"),  # the config wins
    (False, {}, "avx512f avx512_bf16", BF16, False, False, "config"),
])
def test_choose(monkeypatch, setting, env, flags, dtype, compile_, on, reason):
    from planaria.engine import batch_invariance

    monkeypatch.setattr(cpu_ext, "cpu_flags", lambda: flags)
    got = batch_invariance.choose(setting, torch.device("cpu"), dtype, compile_, environ=env)
    assert (got.on, got.reason) == (on, reason)


def test_choose_without_the_kernels(monkeypatch):
    from planaria.engine import batch_invariance

    monkeypatch.setattr(cpu_ext, "enabled", False)
    assert not batch_invariance.choose(None, torch.device("cpu"), BF16, environ={}).on
    with pytest.raises(EngineError, match="needs the C.. CPU kernels"):
        batch_invariance.choose(True, torch.device("cpu"), BF16, environ={})
    with pytest.raises(EngineError, match="needs the C.. CPU kernels"):
        batch_invariance.choose(None, torch.device("cpu"), BF16, environ={"PLANARIA_BATCH_INVARIANT": "1"})
    with pytest.raises(EngineError, match="must be 0 or 1"):
        batch_invariance.choose(None, torch.device("cpu"), BF16, environ={"PLANARIA_BATCH_INVARIANT": "yes"})
