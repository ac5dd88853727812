"""Prompt logprobs over real HTTP: the frontend process and an engine-core process on the
random-weight tiny-moe in float32, driven by the official openai client. ``echo`` with
``logprobs`` on /v1/completions covers the prompt's tokens first (the first one null),
vLLM's ``prompt_logprobs`` comes back in each completion choice and at the top of a chat
body; the values equal transformers' float32 log_softmax on the same checkpoint, also for
prompts prefilled over several steps (a 32-token step budget)."""

from __future__ import annotations

import random

import openai
import pytest
import torch

from tests.frontend._stack import openai_client, prefill_tokens, run_async, serving

BUDGET = 32  # max_num_batched_tokens: longer prompts are prefilled in chunks
ENGINE_CONFIG = dict(kv_cache_bytes=16 * 2**20, max_model_len=512, max_num_seqs=8,
                     max_num_batched_tokens=BUDGET, num_threads=1, dtype="float32")
ATOL = 1e-4


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from planaria.engine.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("prompt-logprobs-http")
    with serving(root, build_demo_model(root / "tiny-moe", "tiny-moe"), 1, ENGINE_CONFIG) as s:
        yield s


@pytest.fixture(scope="module")
def hf(stack):
    """(tokenizer, prompt ids -> [P, V] float32 log_softmax) of the stack's checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(stack.model, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)

    return AutoTokenizer.from_pretrained(stack.model), logprobs


def run(coro, timeout_s: float = 120.0):
    return run_async(coro, timeout_s)


def oai(stack) -> openai.AsyncOpenAI:
    return openai_client(stack, 120)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n)]


def check_echo(lp, ids: list[int], ref: torch.Tensor, tok, num_top: int, num_generated: int) -> None:
    """Completions logprobs of an echoed prompt ``ids`` then ``num_generated`` tokens."""
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + num_generated
    assert lp.tokens[:n] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes it
    want = [float(ref[i - 1, ids[i]]) for i in range(1, n)]
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=ATOL)
    for i in range(1, n):
        top = lp.top_logprobs[i]
        assert num_top <= len(top) <= num_top + 1  # the top-n, and the prompt token when not among them
        assert max(top.values()) == pytest.approx(float(ref[i - 1].max()), abs=ATOL)
    assert all(isinstance(x, float) for x in lp.token_logprobs[n:])
    assert lp.text_offset[0] == 0  # offsets count on across the prompt into the output
    assert all(lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i]) for i in range(len(lp.tokens) - 1))


def test_echo_with_logprobs_matches_transformers(stack, hf):
    tok, ref_of = hf
    text = "import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n"
    text_ids = tok.encode(text, add_special_tokens=True)
    long_ids = _ids(150, seed=1)  # about five steps of prefill

    async def main():
        async with oai(stack) as c:
            r1 = await c.completions.create(model="tiny-moe", prompt=text, echo=True, logprobs=2, max_tokens=3,
                                            temperature=0, extra_body={"ignore_eos": True})
            r2 = await c.completions.create(model="tiny-moe", prompt=long_ids, echo=True, logprobs=3, max_tokens=4,
                                            temperature=0, extra_body={"ignore_eos": True})
            return r1, r2

    r1, r2 = run(main())
    assert r1.usage.prompt_tokens == len(text_ids) and r2.usage.prompt_tokens == 150
    assert r1.choices[0].text.startswith(text)
    check_echo(r1.choices[0].logprobs, text_ids, ref_of(text_ids), tok, 2, 3)
    check_echo(r2.choices[0].logprobs, long_ids, ref_of(long_ids), tok, 3, 4)
    assert r1.model_dump()["choices"][0]["prompt_logprobs"] is None  # the vLLM field was not asked for


def test_echo_with_logprobs_streamed_equals_the_body(stack):
    ids = _ids(70, seed=2)
    kw = dict(model="tiny-moe", prompt=ids, echo=True, logprobs=1, max_tokens=5, temperature=0,
              extra_body={"ignore_eos": True})

    async def main():
        async with oai(stack) as c:
            body = await c.completions.create(**kw)
            chunks = [ch async for ch in await c.completions.create(stream=True, **kw)]
            return body, chunks

    body, chunks = run(main())
    parts = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs is not None]
    assert len(parts[0].tokens) == 71  # the prompt's entries come with the first token
    streamed = [x for p in parts for x in p.token_logprobs]
    whole = body.choices[0].logprobs.token_logprobs
    assert streamed[0] is None and whole[0] is None and len(streamed) == len(whole) == 75
    assert streamed[1:] == pytest.approx(whole[1:], abs=1e-5)
    assert [o for p in parts for o in p.text_offset] == body.choices[0].logprobs.text_offset
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == body.choices[0].text


def check_vllm_field(pl: list, ids: list[int], ref: torch.Tensor, tok, num_top: int) -> None:
    assert len(pl) == len(ids) and pl[0] is None
    for i in range(1, len(ids)):
        entry = pl[i]
        first = next(iter(entry))
        assert first == str(ids[i])  # the prompt token first, keyed by its id
        got = entry[first]
        assert got["logprob"] == pytest.approx(float(ref[i - 1, ids[i]]), abs=ATOL)
        assert got["decoded_token"] == tok.decode([ids[i]], skip_special_tokens=False)
        rank = int((ref[i - 1] > got["logprob"] + ATOL).sum()) + 1
        assert rank <= got["rank"] <= int((ref[i - 1] >= got["logprob"] - ATOL).sum())
        # the top-n with ranks 1..n, beside the prompt token (one of them, or one more)
        assert len(entry) in (num_top, num_top + 1)
        by_rank = {v["rank"]: v["logprob"] for v in entry.values()}
        want = ref[i - 1].topk(num_top).values.tolist()
        assert [by_rank[k] for k in range(1, num_top + 1)] == pytest.approx(want, abs=ATOL)


def test_prompt_logprobs_field_on_completions_and_chat(stack, hf):
    tok, ref_of = hf
    ids = _ids(100, seed=3)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list three colours"}]
    chat_text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat_ids = tok.encode(chat_text, add_special_tokens=False)

    async def main():
        async with oai(stack) as c:
            r = await c.completions.create(model="tiny-moe", prompt=ids, max_tokens=2, temperature=0,
                                           extra_body={"prompt_logprobs": 2})
            chat = await c.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=2,
                                                   extra_body={"prompt_logprobs": 1})
            plain = await c.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=2)
            return r.model_dump(), chat.model_dump(), plain.model_dump()

    r, chat, plain = run(main())
    choice = r["choices"][0]
    assert choice["logprobs"] is None and r["usage"]["prompt_tokens"] == 100
    check_vllm_field(choice["prompt_logprobs"], ids, ref_of(ids), tok, 2)
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)
    check_vllm_field(chat["prompt_logprobs"], chat_ids, ref_of(chat_ids), tok, 1)
    assert plain["prompt_logprobs"] is None


def test_prompt_logprobs_refusals_name_the_field(stack):
    async def main():
        async with oai(stack) as c:
            errors = []
            for kw in (dict(stream=True, extra_body={"prompt_logprobs": 1}),
                       dict(extra_body={"prompt_logprobs": 21}),
                       dict(echo=True, logprobs=21)):
                with pytest.raises(openai.BadRequestError) as ei:
                    await c.completions.create(model="tiny-moe", prompt="x", max_tokens=2, **kw)
                errors.append(ei.value.body)
            return errors

    params = [e["param"] for e in run(main())]
    assert params == ["prompt_logprobs", "prompt_logprobs", "logprobs"]


def test_n_choices_compute_prompt_logprobs_once_and_share_the_prefill(stack, hf):
    """n = 4 with prompt_logprobs: one sibling computes them (the others take the prompt
    from the prefix cache, as without prompt logprobs), every choice shows the same list.
    Each sibling used to prefill the whole prompt and compute them again (4x the work, and
    4 copies of the entries in one outputs message)."""
    tok, ref_of = hf
    ids = _ids(300, seed=11)  # 300 tokens: ten 32-token chunks

    async def main():
        async with oai(stack) as c:
            return (await c.completions.create(model="tiny-moe", prompt=ids, max_tokens=2, n=4, temperature=1,
                                               seed=5, extra_body={"prompt_logprobs": 2})).model_dump()

    before = prefill_tokens(stack)
    r = run(main())
    prefilled = prefill_tokens(stack) - before
    assert len(r["choices"]) == 4
    first = r["choices"][0]["prompt_logprobs"]
    check_vllm_field(first, ids, ref_of(ids), tok, 2)
    assert all(ch["prompt_logprobs"] == first for ch in r["choices"])
    # once (a fresh prompt: the first sibling computes it all), not once per choice
    assert len(ids) <= prefilled < 2 * len(ids), f"{prefilled} prompt tokens prefilled for n = 4 of {len(ids)}"


def test_prompt_logprobs_beyond_the_value_limit_are_a_400(stack):
    """(prompt tokens - 1) x (top + 1) x choices over RequestLimits.max_prompt_logprob_values
    (262144): two 500-token prompts of 16 choices each echoed with top 20 logprobs is
    2 x 16 x 499 x 21 = 335328."""
    async def main():
        async with oai(stack) as c:
            with pytest.raises(openai.BadRequestError) as ei:
                await c.completions.create(model="tiny-moe", prompt=[_ids(500, seed=1), _ids(500, seed=2)],
                                           max_tokens=2, n=16,
                                           echo=True, logprobs=20)
            return ei.value.body

    err = run(main())
    assert err["param"] == "prompt_logprobs" and "262144" in err["message"]
