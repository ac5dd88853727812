"""Tool calling over real HTTP: the frontend process and an engine-core process serving the
real SmolLM2-135M-Instruct, driven by the official openai client. A named tool choice's
arguments validate against the function's schema and its result, sent back as a "tool"
message, gets an answer in words; "required" makes valid calls; "auto" with the hermes
parser finds a call in the text; every stream reassembles to the non-streamed answer;
bad tools are 400s naming the field."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.engine.test_structured_output import validate
from tests.frontend._stack import Stack

pytest.importorskip("llguidance")
pytestmark = pytest.mark.timeout(600)

ENGINE_CONFIG = {"kv_cache_bytes": 128 * 2**20, "max_model_len": 1024, "max_num_seqs": 8,
                 "max_num_batched_tokens": 1024, "num_threads": 1, "dtype": "float32"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40,
                                                             "description": "The city's name"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def stack(real_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("tools-http")
    s = Stack(root, real_models("smollm2"), 1, ENGINE_CONFIG)
    try:
        s.wait_ready(180)
        yield s
    finally:
        code = s.stop()
        assert code == 0, f"frontend exited {code} on SIGTERM\n{s.log()}"


def run(coro, timeout_s: float = 300.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def oai(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base}/v1", api_key="none", max_retries=0, timeout=240)


async def _model(c: openai.AsyncOpenAI) -> str:
    return (await c.models.list()).data[0].id


async def _both(c: openai.AsyncOpenAI, **kw):
    """The non-streamed choice and the stream's reassembly: (content, [(id, name, arguments)],
    finish_reason, the tool-call deltas as sent)."""
    kw = dict(model=await _model(c), temperature=0.0, max_tokens=MAX_TOKENS, **kw)
    choice = (await c.chat.completions.create(**kw)).choices[0]
    content, calls, finish, deltas = "", {}, None, []
    async for chunk in await c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                deltas.append(tc)
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert slot["id"] is None, "a call's id comes once"
                    slot["id"], slot["name"] = tc.id, tc.function.name
                    assert tc.type == "function"
                slot["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    streamed = (content or None, [(s["name"], s["arguments"]) for _, s in sorted(calls.items())], finish)
    whole = (choice.message.content, [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or []],
             choice.finish_reason)
    assert streamed == whole, (streamed, whole)
    assert all(s["id"].startswith("call_") for s in calls.values())
    return choice, deltas


def _check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in SCHEMAS
    args = json.loads(call.function.arguments)
    validate(args, SCHEMAS[call.function.name])
    return args


def test_named_tool_round_trip(stack):
    async def main():
        async with oai(stack) as c:
            choice, deltas = await _both(c, messages=ASK, tools=TOOLS,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            [call] = choice.message.tool_calls
            args = _check_call(call)
            assert call.function.name == "get_weather" and args["city"]
            # the stream opens the call (id, type, name) and then extends its arguments
            assert deltas[0].id and deltas[0].function.name == "get_weather"
            assert all(d.index == 0 and d.id is None for d in deltas[1:])
            # the result goes back as a "tool" message; the answer is words
            result = {"city": args["city"], "forecast": "sunny", "temperature_c": 21}
            messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
            r = await c.chat.completions.create(model=await _model(c), messages=messages, tools=TOOLS,
                                                tool_choice="none", temperature=0.0, max_tokens=MAX_TOKENS)
            answer = r.choices[0]
            assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
            assert answer.message.content and answer.message.content.strip()
            print(f"call {call.function.arguments} -> answer {answer.message.content!r}")
    run(main())


def test_required_makes_valid_calls(stack):
    async def main():
        async with oai(stack) as c:
            one, _ = await _both(c, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
            assert one.finish_reason == "tool_calls" and one.message.content is None
            assert len(one.message.tool_calls) == 1
            _check_call(one.message.tool_calls[0])
            ask_both = [{"role": "user", "content": "What time is it in Tokyo, and what is the weather there?"}]
            many, _ = await _both(c, messages=ask_both, tools=TOOLS, tool_choice="required")
            assert many.message.tool_calls and many.finish_reason in ("tool_calls", "length")
            for call in many.message.tool_calls:
                _check_call(call)
            print("required:", [(t.function.name, t.function.arguments) for t in many.message.tool_calls])
    run(main())


REGEX = (r'Let me check\. <tool_call>\n\{"name": "get_weather", '
         r'"arguments": \{"city": "[A-Z][a-z]{2,12}"\}\}\n</tool_call>')


def test_auto_hermes_parser_finds_the_call_and_streams_the_same(stack):
    async def main():
        async with oai(stack) as c:
            # the text made to hold a Hermes call (a regex), read back by the parser
            choice, deltas = await _both(c, messages=ASK, tools=TOOLS, extra_body={"guided_regex": REGEX})
            assert choice.message.content == "Let me check." and choice.finish_reason == "tool_calls"
            [call] = choice.message.tool_calls
            assert call.function.name == "get_weather" and _check_call(call)["city"][0].isupper()
            assert len(deltas) == 1  # sent whole, once its closing tag arrived
            # free text: whatever the model writes, the stream is the same answer
            free, _ = await _both(c, messages=ASK, tools=TOOLS, tool_choice="auto")
            for call in free.message.tool_calls or []:
                assert call.type == "function" and call.id.startswith("call_")
            if free.message.tool_calls:
                assert free.finish_reason in ("tool_calls", "length")
            else:
                assert free.message.content and free.finish_reason in ("stop", "length")
            print("auto:", free.message.content, free.message.tool_calls)
    run(main())


def test_bad_tools_are_400_naming_the_field(stack):
    cases = [
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
         "tools[0].function.parameters"),
        (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}],
              tools=TOOLS), "messages[0].tool_calls[0].function"),
    ]

    async def main():
        async with oai(stack) as c:
            for kw, param in cases:
                kw.setdefault("messages", ASK)
                with pytest.raises(openai.BadRequestError) as ei:
                    await c.chat.completions.create(model=await _model(c), max_tokens=4, **kw)
                assert ei.value.body["param"] == param, (kw, ei.value.body)
            # the server is fine after them
            r = await c.chat.completions.create(model=await _model(c), messages=ASK, max_tokens=4)
            assert r.choices[0].finish_reason == "length"
    run(main())
