"""Sampling controls and the token endpoints over real HTTP: the frontend process and an
engine-core process on a random-weight tiny-moe, driven by the official openai client.
logit_bias (-100 keeps greedy's token out, +100 makes greedy pick one, a bias never
leaves a guided_choice grammar), allowed_token_ids, bad_words, their 400s naming the
field, the usage chunk of stream_options.include_usage, and /tokenize, /detokenize.

Token ids are learned from the server itself: a token's text (completions logprobs show
each generated token's text) maps to an id when /tokenize gives exactly one id and
/detokenize gives the text back."""

from __future__ import annotations


import aiohttp
import openai
import pytest

from tests.frontend._stack import openai_client, run_async, serving

MODEL = "tiny-moe"
MAX_MODEL_LEN = 512
ENGINE_CONFIG = dict(kv_cache_bytes=16 * 2**20, max_model_len=MAX_MODEL_LEN, max_num_seqs=32,
                     max_num_batched_tokens=1024, num_threads=1)
PROMPTS = ["def add(a, b):", "Hello there, how", "import numpy as np\n", "The quick brown fox",
           "1, 2, 3,", "class Foo:\n    def", "SELECT * FROM", "Once upon a time"]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from planaria.engine.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("controls-http")
    with serving(root, build_demo_model(root / "tiny-moe", "tiny-moe"), 1, ENGINE_CONFIG) as s:
        yield s


def run(coro, timeout_s: float = 120.0):
    return run_async(coro, timeout_s)


def oai(stack) -> openai.AsyncOpenAI:
    return openai_client(stack, 60)


async def post(stack, path: str, body) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.base + path, json=body) as r:
            return r.status, await r.json(content_type=None)


async def tokenize(stack, text: str) -> list[int]:
    status, body = await post(stack, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200, body
    return body["tokens"]


async def detokenize(stack, ids: list[int]) -> str:
    status, body = await post(stack, "/detokenize", {"tokens": ids})
    assert status == 200, body
    return body["prompt"]


async def token_id(stack, text: str) -> int | None:
    """The id of ``text`` when it is exactly one token that decodes back to it."""
    ids = await tokenize(stack, text)
    return ids[0] if len(ids) == 1 and await detokenize(stack, ids) == text else None


async def greedy_tokens(c, prompt: str, n: int, **kw) -> list[str]:
    """The text of each of ``n`` greedily generated tokens."""
    extra = {**NO_EOS, **kw.pop("extra_body", {})}
    r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, logprobs=0,
                                   extra_body=extra, **kw)
    return r.choices[0].logprobs.tokens


def test_logit_bias_minus_100_keeps_greedys_token_out_plus_100_forces_one(stack):
    async def main():
        async with oai(stack) as c:
            found = None
            for prompt in PROMPTS:  # greedy's first token, as text and id
                first = (await greedy_tokens(c, prompt, 1))[0]
                t = await token_id(stack, first)
                if t is not None:
                    found = prompt, first, t
                    break
            assert found, "no prompt's first greedy token round-trips through /tokenize"
            prompt, first, t = found
            banned = await greedy_tokens(c, prompt, 16, logit_bias={str(t): -100})
            assert first not in banned and len(banned) == 16
            forced = None
            for text in ("zebra", " the", "x", "Q", "?"):
                f = await token_id(stack, text)
                if f is not None and f != t:
                    forced = text, f
                    break
            assert forced
            text, f = forced
            assert await greedy_tokens(c, prompt, 6) != [text] * 6  # the bias, not the model, picks it
            assert await greedy_tokens(c, prompt, 6, logit_bias={str(f): 100}) == [text] * 6
            chat = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=4, temperature=0, logit_bias={str(f): 100},
                                                   extra_body=NO_EOS)
            assert chat.choices[0].message.content == text * 4
            # streamed, random: the bias still wins every draw
            stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0,
                                                seed=3, logit_bias={str(f): 100}, stream=True, extra_body=NO_EOS)
            assert "".join([ch.choices[0].text async for ch in stream if ch.choices]) == text * 5
    run(main())


def test_bias_with_a_grammar_never_leaves_the_grammar(stack):
    pytest.importorskip("llguidance")
    choices = ["yes", "no", "maybe so"]

    async def main():
        async with oai(stack) as c:
            outside = set(await tokenize(stack, "zebra quux 12345 {}[] the of"))
            inside = [(await tokenize(stack, w))[0] for w in ("yes", "no")]
            bias = {str(t): 100 for t in outside} | {str(t): -100 for t in inside}
            for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2), (2.0, 3)):
                r = await c.completions.create(model=MODEL, prompt="Answer:", max_tokens=20, temperature=temperature,
                                               seed=seed, logit_bias=bias, extra_body={"guided_choice": choices})
                assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"
            chat = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "?"}],
                                                   max_tokens=20, temperature=0, logit_bias=bias,
                                                   extra_body={"guided_choice": choices})
            assert chat.choices[0].message.content in choices
    run(main())


def test_allowed_token_ids_restrict_every_output_token(stack):
    async def main():
        async with oai(stack) as c:
            ids = sorted(set(await tokenize(stack, " the cat sat on the mat, and")))
            texts = {await detokenize(stack, [i]) for i in ids}
            r = await c.completions.create(model=MODEL, prompt="Once upon", max_tokens=24, temperature=1.0, seed=7,
                                           logprobs=0, extra_body={"allowed_token_ids": ids, **NO_EOS})
            tokens = r.choices[0].logprobs.tokens
            assert len(tokens) == 24 and set(tokens) <= texts
            chat = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=1.5,
                logprobs=True, extra_body={"allowed_token_ids": ids, **NO_EOS})
            assert {t.token for t in chat.choices[0].logprobs.content} <= texts
    run(main())


def test_bad_words_keep_the_word_out(stack):
    async def main():
        async with oai(stack) as c:
            found = None
            for prompt in PROMPTS:  # a word greedy writes as one token that bad_words will forbid
                for s in dict.fromkeys(await greedy_tokens(c, prompt, 12)):
                    word = s.strip()
                    if not word.isalnum() or await token_id(stack, s) is None:
                        continue
                    # vLLM's rule: " word" is forbidden when "word" is as many tokens (here one)
                    if s == word or (s == " " + word and len(await tokenize(stack, word)) == 1):
                        found = prompt, s, word
                        break
                if found:
                    break
            assert found, "no greedy output holds a one-token word"
            prompt, s, word = found
            tokens = await greedy_tokens(c, prompt, 12, extra_body={"bad_words": [word]})
            assert s not in tokens and len(tokens) == 12
    run(main())


def test_controls_leaving_no_token_and_bad_values_are_400_naming_the_field(stack):
    async def main():
        async with oai(stack) as c:
            x = await token_id(stack, "x")
            assert x is not None
            with pytest.raises(openai.BadRequestError, match="no token can be sampled"):
                await c.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                           extra_body={"allowed_token_ids": [x], "bad_words": ["x"]})
            cases = [
                (dict(logit_bias={"abc": 1}), "logit_bias"),
                (dict(logit_bias={"100000": 1}), "logit_bias"),
                (dict(extra_body={"allowed_token_ids": []}), "allowed_token_ids"),
                (dict(extra_body={"allowed_token_ids": [10**6]}), "allowed_token_ids"),
                (dict(extra_body={"bad_words": [""]}), "bad_words"),
                (dict(extra_body={"bad_words": "x"}), "bad_words"),
            ]
            for kw, param in cases:
                with pytest.raises(openai.BadRequestError) as ei:
                    await c.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kw)
                assert ei.value.body["param"] == param, (kw, ei.value.body)
            with pytest.raises(openai.BadRequestError) as ei:
                await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                logit_bias={"-3": 5})
            assert ei.value.body["param"] == "logit_bias"
        for path, body, status, param in [
            ("/tokenize", {}, 400, "prompt"),
            ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "messages"),
            ("/tokenize", {"prompt": 5}, 400, "prompt"),
            ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
            ("/tokenize", {"messages": [{"role": "robot", "content": "b"}]}, 400, "messages[0].role"),
            ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
            ("/detokenize", {"tokens": "x"}, 400, "tokens"),
            ("/detokenize", {"tokens": list(range(16 * MAX_MODEL_LEN + 1))}, 400, "tokens"),
        ]:
            got, err = await post(stack, path, body)
            assert (got, err["error"]["param"]) == (status, param), (path, body, err)
    run(main())


def test_tokenize_then_detokenize_round_trips_and_matches_generation(stack):
    text = "Hello, world! def f(x):\n    return x * 2  # done"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]

    async def main():
        status, r = await post(stack, "/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False})
        assert status == 200 and r["count"] == len(r["tokens"]) > 1 and r["max_model_len"] == MAX_MODEL_LEN
        assert r["token_strs"] is None
        assert await detokenize(stack, r["tokens"]) == text
        status, strs = await post(stack, "/tokenize", {"prompt": text, "return_token_strs": True})
        assert status == 200 and len(strs["token_strs"]) == strs["count"]
        status, chat_ids = await post(stack, "/tokenize", {"messages": messages})
        assert status == 200 and "hi there" in await detokenize(stack, chat_ids["tokens"])
        async with oai(stack) as c:  # the same prompts as generation would send
            done = await c.completions.create(model=MODEL, prompt=text, max_tokens=1)
            assert done.usage.prompt_tokens == strs["count"]
            chat = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
            assert chat.usage.prompt_tokens == chat_ids["count"]
        status, bare = await post(stack, "/tokenize", {"messages": messages, "add_generation_prompt": False})
        assert status == 200 and bare["count"] < chat_ids["count"]
    run(main())


def test_include_usage_puts_usage_in_a_final_chunk_of_its_own(stack):
    async def main():
        async with oai(stack) as c:
            stream = await c.completions.create(model=MODEL, prompt="def f(x):", max_tokens=5, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=NO_EOS)
            chunks = [ch async for ch in stream]
            stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=5, stream=True,
                                                     stream_options={"include_usage": True}, extra_body=NO_EOS)
            chat_chunks = [ch async for ch in stream]
            for cs in (chunks, chat_chunks):
                last = cs[-1]
                assert last.choices == [] and last.usage.completion_tokens == 5
                assert last.usage.prompt_tokens > 0 and last.usage.total_tokens == last.usage.prompt_tokens + 5
                assert all(ch.usage is None for ch in cs[:-1]) and len(cs) > 2
            plain = await c.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=True, extra_body=NO_EOS)
            assert all(ch.usage is None and ch.choices for ch in [ch async for ch in plain])
    run(main())
