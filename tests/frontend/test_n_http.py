"""n > 1 and best_of over real HTTP with the official openai client: the frontend process
and two engine-core processes on a random-weight tiny-moe (float32).

n seeded choices differ from each other and each is reproducible (choice j is the n = 1
request with seed + j); the n siblings run on one engine and prefill the prompt once
(the engines' prefill counters on /metrics); streaming carries each choice's index and
reassembles to the whole body; a prompt counts once in usage; best_of returns the
candidate with the highest cumulative logprob; several prompts times n index as
prompt * n + j."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.frontend._stack import openai_client, prefill_tokens, run_async, serving

MODEL = "tiny-moe"
BLOCK_SIZE = 16
ENGINE_CONFIG = dict(kv_cache_bytes=16 * 2**20, max_model_len=512, max_num_seqs=32, block_size=BLOCK_SIZE,
                     max_num_batched_tokens=64, num_threads=1)  # a 64-token step: long prompts go in chunks
PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
          "\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
          "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n")
SAMPLE = dict(temperature=1.0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from planaria.engine.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("n-http")
    with serving(root, build_demo_model(root / "tiny-moe", "tiny-moe"), 2, ENGINE_CONFIG) as s:
        yield s


def run(coro, timeout_s: float = 120.0):
    return run_async(coro, timeout_s)


def oai(stack) -> openai.AsyncOpenAI:
    return openai_client(stack, 60)


def test_n_seeded_choices_differ_reproduce_and_prefill_once(stack):
    async def main():
        c = oai(stack)
        before = prefill_tokens(stack)  # the first request with this prompt: nothing cached
        r = await c.completions.create(model=MODEL, prompt=PROMPT, n=4, seed=7, **SAMPLE)
        used = prefill_tokens(stack) - before
        num_prompt = r.usage.prompt_tokens
        assert num_prompt > 64  # chunked: two steps at least
        again = await c.completions.create(model=MODEL, prompt=PROMPT, n=4, seed=7, **SAMPLE)
        singles = await asyncio.gather(*(c.completions.create(model=MODEL, prompt=PROMPT, seed=7 + j, **SAMPLE)
                                         for j in range(4)))
        return num_prompt, used, r, again, singles

    num_prompt, used, r, again, singles = run(main())
    texts = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in sorted(r.choices, key=lambda ch: ch.index)] == [0, 1, 2, 3]
    assert len(set(texts)) == 4, texts  # four different samples
    assert [ch.text for ch in sorted(again.choices, key=lambda ch: ch.index)] == texts  # reproducible
    assert [s.choices[0].text for s in singles] == texts  # choice j is seed + j
    assert r.usage.prompt_tokens == num_prompt  # the prompt counts once
    assert r.usage.completion_tokens == 4 * 12
    # one prefill: the first sibling computes the prompt, the others only its last block
    assert num_prompt <= used <= num_prompt + 3 * BLOCK_SIZE, (used, num_prompt)


def test_n_streamed_carries_indexes_and_equals_the_body(stack):
    async def main():
        c = oai(stack)
        whole = await c.completions.create(model=MODEL, prompt="Once upon a time", n=3, seed=11, **SAMPLE)
        parts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        stream = await c.completions.create(model=MODEL, prompt="Once upon a time", n=3, seed=11, stream=True,
                                            stream_options={"include_usage": True}, **SAMPLE)
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                parts[ch.index] = parts.get(ch.index, "") + ch.text
                if ch.finish_reason:
                    finishes[ch.index] = ch.finish_reason
        chat = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                               seed=3, **SAMPLE)
        chat_stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      n=2, seed=3, stream=True, **SAMPLE)
        chat_parts: dict[int, str] = {}
        async for chunk in chat_stream:
            for ch in chunk.choices:
                chat_parts[ch.index] = chat_parts.get(ch.index, "") + (ch.delta.content or "")
        one = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **SAMPLE)
        return whole, parts, finishes, usage, chat, chat_parts, one

    whole, parts, finishes, usage, chat, chat_parts, one = run(main())
    assert parts == {ch.index: ch.text for ch in whole.choices}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == 36
    assert sorted(ch.index for ch in chat.choices) == [0, 1]
    assert chat_parts == {ch.index: ch.message.content for ch in chat.choices}
    assert chat.usage.prompt_tokens == one.usage.prompt_tokens  # once, not twice
    assert chat.usage.completion_tokens == 24


def test_best_of_returns_the_most_likely_candidate(stack):
    async def main():
        c = oai(stack)
        cands = await c.completions.create(model=MODEL, prompt="1, 2, 3,", n=4, seed=5, logprobs=0, **SAMPLE)
        best = await c.completions.create(model=MODEL, prompt="1, 2, 3,", n=1, best_of=4, seed=5, **SAMPLE)
        best2 = await c.completions.create(model=MODEL, prompt="1, 2, 3,", n=2, best_of=4, seed=5, logprobs=0,
                                           **SAMPLE)
        return cands, best, best2

    cands, best, best2 = run(main())
    score = {ch.text: sum(ch.logprobs.token_logprobs) for ch in cands.choices}
    ranked = sorted(cands.choices, key=lambda ch: (-score[ch.text], ch.index))
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text == ranked[0].text
    assert best.choices[0].logprobs is None  # not asked for: not shown
    assert [ch.text for ch in sorted(best2.choices, key=lambda ch: ch.index)] == [ranked[0].text, ranked[1].text]
    assert best2.choices[0].logprobs is not None
    assert best.usage.completion_tokens == 4 * 12  # every candidate was generated


def test_several_prompts_times_n_and_echo(stack):
    async def main():
        c = oai(stack)
        r = await c.completions.create(model=MODEL, prompt=["Hello there", "SELECT * FROM"], n=2, seed=1,
                                       echo=True, **SAMPLE)
        singles = [await c.completions.create(model=MODEL, prompt=p, seed=1 + j, **SAMPLE)
                   for p in ("Hello there", "SELECT * FROM") for j in range(2)]
        return r, singles

    r, singles = run(main())
    by_index = {ch.index: ch.text for ch in r.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    for i, p in enumerate(("Hello there", "SELECT * FROM")):
        for j in range(2):
            assert by_index[i * 2 + j] == p + singles[i * 2 + j].choices[0].text


def test_n_limits_are_400s(stack):
    async def main():
        c = oai(stack)
        errors = []
        for kw in ({"n": 17}, {"n": 2, "best_of": 1}, {"n": 1, "best_of": 2, "stream": True}):
            with pytest.raises(openai.BadRequestError) as ei:
                r = await c.completions.create(model=MODEL, prompt="x", max_tokens=2, **kw)
                if kw.get("stream"):
                    async for _ in r:
                        pass
            errors.append(ei.value.body)
        return errors

    errors = run(main())
    assert [e["param"] for e in errors] == ["n", "best_of", "best_of"]
