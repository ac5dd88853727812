"""tools / tool_choice checking, the forced choices' grammars, and tools in the prompt:
written into the messages for a template that does not know them (SmolLM2's), handed to
one that does (a Qwen-style template on the same real tokenizer)."""

from __future__ import annotations

import json

import pytest

from planaria.frontend.errors import RequestError
from planaria.frontend.prompts import tokenize_chat
from planaria.frontend.protocol import decode_chat
from planaria.frontend.tool_parsers import HermesToolParser, parse
from planaria.frontend.tools import tool_plan
from tests.engine.test_structured_output import validate
from tests.frontend._fakes import FakeTokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: none needed
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ROUND_TRIP = [*USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


def request(**body):
    body.setdefault("messages", USER)
    return decode_chat(json.dumps(body).encode())


def plan(parser=HermesToolParser(), **body):
    return tool_plan(request(**body), parser)


def test_modes_and_defaults():
    assert plan().mode == "none" and plan().template_tools is None
    assert plan(tools=[WEATHER]).mode == "auto"  # OpenAI's default with tools
    assert plan(parser=None, tools=[WEATHER]).mode == "none"  # no parser: no auto by default
    assert plan(tools=[WEATHER], tool_choice="none").mode == "none"
    assert plan(tool_choice="auto").mode == "none"  # nothing to call
    p = plan(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (p.mode, p.name) == ("named", "get_time")
    assert p.tools[1] == {"type": "function", "function": {"name": "get_time", "parameters":
                                                           {"type": "object", "properties": {}}}}
    assert plan(tools=[WEATHER], tool_choice="required").mode == "required"
    assert plan(tools=[WEATHER]).structured_output({"type": "regex", "value": "a"}) == {"type": "regex", "value": "a"}


def test_forced_choices_set_a_grammar_their_output_follows():
    named = plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    spec = named.structured_output(None)
    assert spec["type"] == "json_schema" and json.loads(spec["value"]) == WEATHER["function"]["parameters"]
    required = plan(tools=[WEATHER, TIME], tool_choice="required")
    schema = json.loads(required.structured_output(None)["value"])
    validate_any([{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}],
                 schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}],
                [{"name": "get_time", "arguments": {}, "more": 1}]):
        with pytest.raises(AssertionError):
            validate_any(bad, schema)
    single = plan(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(single.structured_output(None)["value"])["maxItems"] == 1
    with pytest.raises(RequestError) as ei:
        required.structured_output({"type": "json_object", "value": None})
    assert ei.value.param == "tool_choice" and "cannot be combined" in ei.value.message


def validate_any(value, schema: dict, path: str = "$") -> None:
    """``validate`` (tests/engine/test_structured_output.py) with ``anyOf`` in array items."""
    if schema.get("type") == "array" and "anyOf" in schema["items"]:
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9), path
        for i, item in enumerate(value):
            assert any(_valid(item, sub) for sub in schema["items"]["anyOf"]), f"{path}[{i}]"
        return
    validate(value, schema, path)


def _valid(value, schema: dict) -> bool:
    try:
        validate(value, schema)
    except AssertionError:
        return False
    return True


def _fn(**fields):
    return {"type": "function", "function": {"name": "f", **fields}}


BAD = [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "must be 'function'"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "object with a name"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name", "1 to 64"),
    ({"tools": [_fn(name="has space")]}, "tools[0].function.name", "letters, digits"),
    ({"tools": [_fn(name="x" * 65)]}, "tools[0].function.name", "1 to 64"),
    ({"tools": [_fn(name="ok\n")]}, "tools[0].function.name", "1 to 64"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "given twice"),
    ({"tools": [_fn(description=5)]}, "tools[0].function.description", "string"),
    ({"tools": [_fn(parameters=[1])]}, "tools[0].function.parameters", "JSON schema"),
    ({"tools": [_fn(parameters={"type": "string"})]}, "tools[0].function.parameters", "describe an object"),
    ({"tools": [_fn(parameters={"properties": {"x": 3}})]}, "tools[0].function.parameters.properties", "schemas"),
    ({"tools": [_fn(parameters={"required": "x"})]}, "tools[0].function.parameters.required", "list"),
    ({"tools": [_fn(parameters={"type": "object", "properties": {"x": {"type": "no-such-type"}}})],
      "tool_choice": "required"}, "tools[0].function.parameters", "Invalid type: no-such-type"),
    ({"tools": [_fn()], "tool_choice": "sometimes"}, "tool_choice", "one of none, auto, required"),
    ({"tools": [_fn()], "tool_choice": {"type": "function"}}, "tool_choice", '"function": {"name"'),
    ({"tools": [_fn()], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "needs tools"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools"),
    ({"function_call": "auto"}, "function_call", "tool_choice"),
]


@pytest.mark.parametrize("body,param,reason", BAD, ids=[json.dumps(b)[:60] for b, _, _ in BAD])
def test_bad_tools_are_400_naming_the_field(body, param, reason):
    with pytest.raises(RequestError) as ei:
        plan(**body)
    assert ei.value.status == 400 and ei.value.param == param and reason in ei.value.message, ei.value.message


def test_auto_without_a_parser_is_refused():
    with pytest.raises(RequestError) as ei:
        plan(parser=None, tools=[WEATHER], tool_choice="auto")
    assert ei.value.param == "tool_choice" and "--tool-call-parser none" in ei.value.message


def _render(tokenizer, **body) -> str:
    req = request(**body)
    return tokenize_chat(req, tokenizer, tools=tool_plan(req, HermesToolParser()).template_tools).text


def test_template_without_tools_gets_them_written_hermes_style():
    text = _render(FakeTokenizer(), tools=[WEATHER], messages=[{"role": "system", "content": "Be brief."}, *ROUND_TRIP,
                                                                {"role": "tool", "content": "and windy"}])
    system, rest = text.split("\n<user>", 1)
    assert system.startswith("<system>Be brief.\n\n# Tools\n") and json.dumps(WEATHER) in system
    assert "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" in system
    # the assistant's call in the convention the parser reads; both results in one user turn
    call = rest.split("<assistant>", 1)[1].split("\n<user>", 1)[0]
    assert parse(HermesToolParser(), call).calls[0].name == "get_weather"
    assert "<user><tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\nand windy\n</tool_response>\n" \
        in rest and rest.endswith("<assistant>")
    no_system = _render(FakeTokenizer(), tools=[WEATHER])
    assert no_system.startswith("<system># Tools\n")
    # tool messages render without tools in the request too; assistant content before its calls
    text = _render(FakeTokenizer(), messages=[*USER, {"role": "assistant", "content": "Checking.",
                                                      "tool_calls": [CALL]}, ROUND_TRIP[2]])
    assert "<assistant>Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}" in text


BAD_MESSAGES = [
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages[0].tool_calls", "only assistant"),
    ([{"role": "assistant", "tool_calls": [{"id": "x"}]}], "messages[0].tool_calls[0].function", "string name"),
    ([{"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}],
     "messages[0].tool_calls[0].type", "'function'"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}],
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
    ([{"role": "assistant", "tool_calls": [{"id": 5, "function": {"name": "f"}}]}],
     "messages[0].tool_calls[0].id", "string"),
]


@pytest.mark.parametrize("messages,param,reason", BAD_MESSAGES, ids=[p for _, p, _ in BAD_MESSAGES])
def test_bad_tool_messages_are_400(messages, param, reason):
    with pytest.raises(RequestError) as ei:
        _render(FakeTokenizer(), messages=messages)
    assert ei.value.param == param and reason in ei.value.message, ei.value.message


# Tools in the system turn, calls as Hermes blocks, arguments with tojson (Qwen2.5's
# shape); the newlines sit inside string literals, out of reach of HF's trim_blocks.
QWEN_STYLE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n<tools>' }}{% for tool in tools %}"
    "{{ '\n' + (tool | tojson) }}{% endfor %}{{ '\n</tools><|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message.role + '\n' + message.content }}"
    "{% for tool_call in message.tool_calls or [] %}{{ '\n<tool_call>\n{\"name\": \"' + tool_call.function.name"
    " + '\", \"arguments\": ' + (tool_call.function.arguments | tojson) + '}\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_real_templates(real_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_models("smollm2"))
    # SmolLM2-Instruct's own template writes role and content only: the tools are written in
    text = _render(tok, tools=[WEATHER], messages=ROUND_TRIP)
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "get_weather"' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in text
    # a template that knows tools gets them, and the call's arguments as an object
    tok.chat_template = QWEN_STYLE
    text = _render(tok, tools=[WEATHER], messages=ROUND_TRIP)
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>\n{") and "<|im_start|>tool\nsunny, 21 C" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert json.loads(text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]) == WEATHER
