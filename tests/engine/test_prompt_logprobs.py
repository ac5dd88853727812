"""Prompt logprobs (SamplingParams.prompt_logprobs) through the offline LLM API on the
random-weight tiny-moe in float32: per prompt position the logprob of the next prompt
token, its rank and the top-n equal transformers' log_softmax on the same checkpoint,
whole prompts or prefilled in chunks, with prefix caching on (such a request takes no
hit) and under preemption; and the chunk bookkeeping on its own."""

from __future__ import annotations

import random

import pytest
import torch

from planaria.engine import LLM, SamplingParams
from planaria.engine.messages import Logprobs
from planaria.engine.prompt_logprobs import accept, take
from planaria.engine.request import Request

ATOL = 1e-4


def _prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in lens]


_hf: dict[str, object] = {}


def hf_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log_softmax at every prompt position: [P, V]."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _hf:
        _hf[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = _hf[model_dir](torch.tensor([prompt])).logits[0]  # [P, V]
    return logits.float().log_softmax(dim=-1)


def check_against_hf(model_dir: str, prompt: list[int], got: list[Logprobs | None], num_top: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    ref = hf_logprobs(model_dir, prompt)
    for pos in range(len(prompt) - 1):
        e = got[pos + 1]
        tok = prompt[pos + 1]
        assert e.token_ids[0] == tok and len(e.token_ids) == len(e.logprobs) == num_top + 1
        want = float(ref[pos, tok])
        assert e.logprobs[0] == pytest.approx(want, abs=ATOL), (pos, e.logprobs[0], want)
        # rank: 1-based, tokens at least as likely (a near-tie may fall either side)
        lo = int((ref[pos] > want + ATOL).sum()) + 1
        hi = int((ref[pos] >= want - ATOL).sum())
        assert lo <= e.sampled_rank <= hi, (pos, e.sampled_rank, lo, hi)
        # the top-n: the n largest values, each the reference's value for its token
        top = ref[pos].topk(num_top).values.tolist()
        assert e.logprobs[1:] == pytest.approx(top, abs=ATOL)
        assert [float(ref[pos, t]) for t in e.token_ids[1:]] == pytest.approx(e.logprobs[1:], abs=ATOL)


@pytest.mark.parametrize("budget", [2048, 48], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(tiny_moe, budget):
    """budget 48: every prompt over 48 tokens is prefilled over several steps, sharing them
    with the other requests' chunks and decodes."""
    prompts = _prompts([1, 2, 17, 47, 48, 49, 130, 200])
    llm = LLM(tiny_moe, dtype="float32", max_num_seqs=8, max_num_batched_tokens=budget,
              kv_cache_bytes=32 * 2**20)
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k) for k in (3, 3, 0, 5, 3, 2, 4, 3)]
    params.append(SamplingParams(temperature=0, max_tokens=3, logprobs=2))  # none asked: none sent
    outs = llm.generate(prompts + [prompts[-1]], params)
    for out, prompt, p in zip(outs, prompts, params):
        assert out.finish_reason == "length" and len(out.token_ids) == 3, out.error
        check_against_hf(tiny_moe, prompt, out.prompt_logprobs, p.prompt_logprobs)
    assert outs[-1].prompt_logprobs is None and len(outs[-1].logprobs) == 3


def test_a_request_with_prompt_logprobs_takes_no_prefix_cache_hit(tiny_moe):
    prompt = _prompts([80], seed=1)[0]
    llm = LLM(tiny_moe, dtype="float32", max_num_seqs=4, max_num_batched_tokens=256, kv_cache_bytes=16 * 2**20)
    plain = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate([prompt], plain)[0].num_cached_tokens == 0
    again = llm.generate([prompt], plain)[0]
    assert again.num_cached_tokens == 64  # four full blocks of 16 were cached
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    assert out.num_cached_tokens == 0  # every position ran through the model
    check_against_hf(tiny_moe, prompt, out.prompt_logprobs, 1)
    assert llm.generate([prompt], plain)[0].num_cached_tokens == 64  # the cache is still there


def test_prompt_logprobs_under_preemption(tiny_moe):
    """24 blocks of 16 tokens cannot hold six 100-token prompts and their outputs: requests
    are preempted and recompute; each still gets one entry per prompt position."""
    prompts = _prompts([100] * 6, seed=2)
    llm = LLM(tiny_moe, dtype="float32", max_num_seqs=6, max_num_batched_tokens=64, num_kv_blocks=24,
              enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1))
    assert llm.core.scheduler.num_preemptions > 0
    for out, prompt in zip(outs, prompts):
        assert out.finish_reason == "length", out.error
        check_against_hf(tiny_moe, prompt, out.prompt_logprobs, 1)


def test_prompt_logprobs_are_bounded_like_logprobs(tiny_moe):
    llm = LLM(tiny_moe, max_num_seqs=2, max_num_batched_tokens=64, kv_cache_bytes=8 * 2**20, max_logprobs=5)
    bad, good = llm.generate([[5, 6, 7], [5, 6, 7]], [SamplingParams(prompt_logprobs=6),
                                                       SamplingParams(prompt_logprobs=5, max_tokens=1)])
    assert bad.finish_reason == "error" and "prompt_logprobs must be an integer in [0, 5]" in bad.error
    assert good.finish_reason == "length" and [len(e.token_ids) for e in good.prompt_logprobs[1:]] == [6, 6]


# -- the chunk bookkeeping ------------------------------------------------------------------
def _entries(start: int, n: int) -> list[Logprobs]:
    return [Logprobs([100 + p], [-float(p)], 1) for p in range(start, start + n)]


def test_chunks_join_on_and_recomputed_positions_are_skipped():
    req = Request("r", list(range(20)), SamplingParams(prompt_logprobs=0), None, 4)
    req.prompt_logprobs = []
    assert accept(req, 0, _entries(0, 8)) and accept(req, 8, _entries(8, 4))
    assert accept(req, 0, _entries(0, 10))  # preempted mid-prefill: recomputed from 0
    assert accept(req, 10, _entries(10, 9))
    assert [e.token_ids[0] for e in req.prompt_logprobs] == [100 + p for p in range(19)]
    assert not accept(req, 25, _entries(25, 1))  # a gap: the core fails the request
    assert len(take(req)) == 19 and take(req) is None and not req.wants_prompt_logprobs
    assert accept(req, 0, _entries(0, 3))  # after they were sent (a preemption later): ignored
    assert req.prompt_logprobs is None
