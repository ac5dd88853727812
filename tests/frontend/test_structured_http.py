"""Structured outputs over real HTTP: the frontend process and an engine-core process on a
random-weight tiny-moe, driven by the official openai client. Every constrained output
parses and validates against its spec (response_format json_schema / json_object,
guided_json / guided_regex / guided_choice / guided_grammar, streamed or not); a broken
spec is a 400 for that request only, while the requests around it finish normally."""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest

from tests.engine.test_structured_output import SCHEMAS, validate
from tests.frontend._stack import openai_client, run_async, serving

pytest.importorskip("llguidance")

ENGINE_CONFIG = dict(kv_cache_bytes=16 * 2**20, max_model_len=512, max_num_seqs=32,
                     max_num_batched_tokens=1024, num_threads=1)
MAX_TOKENS = 160
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'


def _bounded(schema):
    """The schema with "number" made "integer": a random model may write a float's digits
    past any token budget, while every other keyword here bounds the output's length."""
    if isinstance(schema, dict):
        return {k: ("integer" if k == "type" and v == "number" else _bounded(v)) for k, v in schema.items()}
    return [_bounded(v) for v in schema] if isinstance(schema, list) else schema


HTTP_SCHEMAS = [_bounded(s) for s in SCHEMAS]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from planaria.engine.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("structured-http")
    with serving(root, build_demo_model(root / "tiny-moe", "tiny-moe"), 1, ENGINE_CONFIG) as s:
        yield s


def run(coro, timeout_s: float = 180.0):
    return run_async(coro, timeout_s)


def oai(stack) -> openai.AsyncOpenAI:
    return openai_client(stack, 120)


async def _streamed_text(stream) -> tuple[str, str | None]:
    text, finish = "", None
    async for chunk in stream:
        for ch in chunk.choices:
            text += getattr(ch, "text", None) or (ch.delta.content if getattr(ch, "delta", None) else "") or ""
            finish = ch.finish_reason or finish
    return text, finish


def test_chat_response_format_json_schema_validates(stack):
    async def one(c, i, schema, seed):
        r = await c.chat.completions.create(
            model="tiny-moe", messages=[{"role": "user", "content": f"JSON please, number {i}"}],
            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        return schema, r.choices[0]

    async def main():
        async with oai(stack) as c:
            return await asyncio.gather(*[one(c, i, schema, seed) for i, schema in enumerate(HTTP_SCHEMAS)
                                          for seed in range(2)])

    for schema, choice in run(main()):
        assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
        validate(json.loads(choice.message.content), schema)


def test_guided_fields_on_completions_streamed_and_not(stack):
    specs = [
        ("json", {"guided_json": HTTP_SCHEMAS[0]}),
        ("json-str", {"guided_json": json.dumps(HTTP_SCHEMAS[3])}),
        ("regex", {"guided_regex": REGEX}),
        ("choice", {"guided_choice": CHOICES}),
        ("grammar", {"guided_grammar": GRAMMAR}),
    ]

    def check(kind: str, text: str, finish: str | None) -> None:
        assert finish == "stop", (kind, finish, text)
        if kind == "json":
            validate(json.loads(text), HTTP_SCHEMAS[0])
        elif kind == "json-str":
            validate(json.loads(text), HTTP_SCHEMAS[3])
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in CHOICES
        else:
            assert re.fullmatch(r"\((\d{1,3})(\+\d{1,3})*\)", text), text

    async def one(c, kind, extra, seed, stream):
        kw = dict(model="tiny-moe", prompt=f"write {kind}", max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        if stream:
            return kind, *await _streamed_text(await c.completions.create(stream=True, extra_body=extra, **kw))
        r = await c.completions.create(extra_body=extra, **kw)
        return kind, r.choices[0].text, r.choices[0].finish_reason

    async def main():
        async with oai(stack) as c:
            return await asyncio.gather(*[one(c, kind, extra, seed, stream) for kind, extra in specs
                                          for seed in range(2) for stream in (False, True)])

    results = run(main())
    assert len(results) == len(specs) * 4
    for kind, text, finish in results:
        check(kind, text, finish)


def test_json_object_outputs_parse(stack):
    """Any JSON object: random weights often write one key for ever (a length finish,
    still a JSON prefix); those that end are objects."""
    async def one(c, seed, stream):
        kw = dict(model="tiny-moe", prompt="write object", max_tokens=256, temperature=1.0, seed=seed,
                  extra_body={"response_format": {"type": "json_object"}})
        if stream:
            return await _streamed_text(await c.completions.create(stream=True, **kw))
        r = await c.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason

    async def main():
        async with oai(stack) as c:
            return await asyncio.gather(*[one(c, seed, stream) for seed in range(8) for stream in (False, True)])

    results = run(main())
    assert all(text.startswith("{") for text, _ in results), results
    ended = [text for text, finish in results if finish == "stop"]
    assert ended, results
    for text in ended:
        assert isinstance(json.loads(text), dict)


BROKEN = [
    ({"guided_json": {"type": "bogus"}}, "bogus"),                      # the engine's compile fails
    ({"guided_json": "{not json"}, None),
    ({"guided_regex": "(("}, None),
    ({"guided_grammar": "start: undefined_rule"}, None),
    ({"guided_choice": []}, "guided_choice"),                           # refused by the frontend
    ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
]


def test_broken_specs_are_400_and_harm_no_other_request(stack):
    async def good(c, i):
        r = await c.completions.create(model="tiny-moe", prompt=f"pick {i}", max_tokens=16, temperature=0,
                                       extra_body={"guided_choice": ["alpha", "beta"]})
        return r.choices[0]

    async def plain(c):
        r = await c.completions.create(model="tiny-moe", prompt="x = ", max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
        return r.choices[0]

    async def broken(c, extra, stream):
        try:
            r = await c.completions.create(model="tiny-moe", prompt="break", max_tokens=16, stream=stream,
                                           extra_body=extra)
            if stream:
                await _streamed_text(r)
        except openai.BadRequestError as exc:
            return exc
        return None

    async def main():
        async with oai(stack) as c:
            tasks = [good(c, i) for i in range(4)] + [plain(c)]
            tasks += [broken(c, extra, stream) for extra, _ in BROKEN for stream in (False, True)]
            results = await asyncio.gather(*tasks)
            after = await good(c, 99)  # the engine serves on
            return results, after

    results, after = run(main())
    goods, plain_out, errors = results[:4], results[4], results[5:]
    for ch in goods + [after]:
        assert ch.finish_reason == "stop" and ch.text in ("alpha", "beta"), ch
    assert plain_out.finish_reason == "length" and plain_out.text
    for (extra, needle), err in zip([b for b in BROKEN for _ in (0, 1)], errors):
        assert isinstance(err, openai.BadRequestError), (extra, err)
        assert err.body["type"] == "invalid_request_error", err.body
        if needle:
            assert needle in err.body["message"], (extra, err.body)
