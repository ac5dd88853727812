"""The Hermes tool-call parser and the per-choice readers on texts: with and without
calls, several calls, malformed JSON (content), unclosed calls, and every way of cutting
a text into deltas gives the answer the whole text gives. Pure and fast."""

from __future__ import annotations

import json

import pytest

from planaria.frontend.tool_calls import (AutoToolCalls, NamedToolCall, RequiredToolCalls, ToolDelta,
                                          finish_reason)
from planaria.frontend.tool_parsers import (TOOL_CALL_PARSERS, HermesToolParser, ParsedToolCall, get_tool_parser,
                                            parse, partial_suffix, register_tool_parser)

HERMES = HermesToolParser()
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC", "n": [1, 2]}}</tool_call>'
PARIS = ParsedToolCall("get_weather", '{"city": "Paris"}')
UTC = ParsedToolCall("get_time", '{"tz": "UTC", "n": [1, 2]}')

CASES = [
    # text, content, calls
    ("The weather is nice.", "The weather is nice.", []),
    ("", "", []),
    (WEATHER, "", [PARIS]),
    ("Let me check.\n" + WEATHER, "Let me check.\n", [PARIS]),
    (WEATHER + "\n" + TIME + "\n", "\n\n", [PARIS, UTC]),
    ("a " + WEATHER + " b " + TIME + " c", "a  b  c", [PARIS, UTC]),
    # malformed: the whole block is content
    *((bad, bad, []) for bad in [
        '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>',  # a brace short
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": {"x": 1}}<tool_call>',  # no closing tag, two opening ones
    ]),
    ("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>" + WEATHER,  # nested past the recursion limit
     "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", [PARIS]),
    # arguments as JSON text, "parameters", no arguments
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [ParsedToolCall("f", '{"x": 1}')]),
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', "", [ParsedToolCall("f", '{"x": 1}')]),
    ('<tool_call>{"name": "f"}</tool_call>', "", [ParsedToolCall("f", "{}")]),
    # unclosed at the end: a call when its JSON is whole, else content
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "", [PARIS]),
    ('ok <tool_call>{"name": "get_weather", "argum', 'ok <tool_call>{"name": "get_weather", "argum', []),
    # a tag's beginning that is not one
    ("x < y and <tool_ca", "x < y and <tool_ca", []),
    ("unicode é 😀 " + WEATHER.replace("Paris", "Zürich"), "unicode é 😀 ",
     [ParsedToolCall("get_weather", '{"city": "Zürich"}')]),
]


@pytest.mark.parametrize("text,content,calls", CASES, ids=[c[0][:40] for c in CASES])
def test_hermes_parse(text, content, calls):
    out = parse(HERMES, text)
    assert out.content == content and out.calls == calls


def test_split_holds_what_may_become_a_call():
    assert HERMES.split("abc<tool_", 0, False) == (["abc"], 3)
    assert HERMES.split("abc<tool_", 0, True) == (["abc<tool_"], 9)
    assert HERMES.split("abc<tool_call>{", 0, False) == (["abc"], 3)  # unclosed: held
    assert HERMES.split("abc<tool_call>{", 3, False) == ([], 3)
    text = "x" + WEATHER + "y<"
    assert HERMES.split(text, 0, False) == (["x", PARIS, "y"], len(text) - 1)
    assert partial_suffix("ab<tool", 0, "<tool_call>") == 5 and partial_suffix("ab<tool", 6, "<tool_call>") == 0
    assert partial_suffix("<tool_call>", 0, "<tool_call>") == 0  # whole: not a partial


def _chunkings(text: str):
    yield [text]
    yield list(text)  # one character at a time
    for size in (2, 3, 5, 7, 13):
        yield [text[i:i + size] for i in range(0, len(text), size)]


def _reassemble(reader, chunks: list[str]) -> tuple[str, list[dict]]:
    """A client's view: content fragments joined, tool-call deltas merged by index."""
    content, calls = "", {}
    for i, chunk in enumerate(chunks):
        delta: ToolDelta = reader.feed(chunk, i == len(chunks) - 1)
        content += delta.content
        for tc in delta.tool_calls:
            slot = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert slot["id"] is None, "a call opens once"
                slot["id"], slot["name"] = tc["id"], tc["function"]["name"]
                assert tc["type"] == "function"
            slot["arguments"] += tc["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def _as_message(content: str, calls: list[dict]) -> tuple[str | None, list[dict]]:
    return content or None, [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


@pytest.mark.parametrize("text,content,calls", CASES, ids=[c[0][:40] for c in CASES])
def test_auto_stream_reassembles_to_the_whole_answer(text, content, calls):
    for chunks in _chunkings(text):
        reader = AutoToolCalls(HERMES)
        got = _reassemble(reader, chunks)
        message = reader.message()
        assert _as_message(*got) == message
        assert message[0] == (content.strip() or None)  # trimmed; only whitespace: null
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in message[1]] == \
            [(c.name, c.arguments) for c in calls]
        assert all(c["id"].startswith("call_") for c in message[1])
        assert len({c["id"] for c in message[1]}) == len(calls)


def test_auto_content_streams_before_the_call_and_holds_a_tag_beginning():
    reader = AutoToolCalls(HERMES)
    assert reader.feed("Let me", False).content == "Let me"
    assert reader.feed(" check. <tool", False).content == " check."  # the space waits, the tag may begin
    assert reader.feed('_call>{"name": "get_weather", ', False) == ToolDelta()
    d = reader.feed('"arguments": {"city": "Paris"}}</tool_call>', False)
    assert d.content == "" and d.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert d.tool_calls[0]["index"] == 0
    assert reader.feed("\n", True) == ToolDelta()
    assert reader.message()[0] == "Let me check." and reader.num_calls == 1
    assert finish_reason("stop", reader.num_calls) == "tool_calls"
    assert finish_reason("length", reader.num_calls) == "length" and finish_reason("stop", 0) == "stop"


def test_named_call_streams_arguments_as_they_come():
    reader = NamedToolCall("get_weather")
    first = reader.feed('{"ci', False).tool_calls
    assert first == [{"index": 0, "id": reader.call_id, "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"ci'}}]
    assert reader.feed('ty":"Paris"}', False).tool_calls == [{"index": 0, "function": {"arguments": 'ty":"Paris"}'}}]
    assert reader.feed("", True) == ToolDelta()
    content, calls = reader.message()
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    empty = NamedToolCall("f")
    assert empty.feed("", True).tool_calls[0]["function"] == {"name": "f", "arguments": ""}


def test_required_calls_each_sent_when_complete():
    text = '[{"name":"get_weather","arguments":{"city":"Paris"}}, {"name":"get_time","arguments":{"tz":"UTC"}}]'
    for chunks in _chunkings(text):
        reader = RequiredToolCalls()
        content, calls = _reassemble(reader, chunks)
        assert content == "" and reader.message() == (None, _as_message(content, calls)[1])
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
            [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    reader = RequiredToolCalls()
    assert reader.feed('[{"name":"get_weather","arguments":{"city":"Pa', False) == ToolDelta()
    assert len(reader.feed('ris"}},', False).tool_calls) == 1
    # cut short (length): the complete calls stay; with none, the text is the content
    assert reader.feed('{"name":"get_ti', True) == ToolDelta() and reader.num_calls == 1
    cut = RequiredToolCalls()
    assert cut.feed('[{"name":"get_wea', True).content == '[{"name":"get_wea'
    assert cut.message() == ('[{"name":"get_wea', [])


def test_registry_is_extensible():
    class Bracket:
        """[CALL name {json}] on one line."""

        def split(self, text, start, final):
            pieces = []
            for line in text[start:].splitlines(keepends=True):
                if line.startswith("[CALL "):
                    name, _, args = line[6:].rstrip("]\n").partition(" ")
                    pieces.append(ParsedToolCall(name, args))
                else:
                    pieces.append(line)
            return pieces, len(text)

    register_tool_parser("bracket", Bracket)
    try:
        assert parse(get_tool_parser("bracket"), 'hi\n[CALL f {"x": 1}]\n').calls == [ParsedToolCall("f", '{"x": 1}')]
    finally:
        del TOOL_CALL_PARSERS["bracket"]
    with pytest.raises(ValueError, match="unknown tool-call parser 'bracket'; known: hermes"):
        get_tool_parser("bracket")


def test_the_daemons_list_of_parser_names_matches_the_frontends_parsers():
    # the daemon checks --tool-call-parser against common's list, never importing the frontend
    from planaria.common.tool_parser_names import BUILTIN_TOOL_CALL_PARSERS, DEFAULT_TOOL_CALL_PARSER
    from planaria.frontend.tool_parsers import TOOL_CALL_PARSERS

    assert set(BUILTIN_TOOL_CALL_PARSERS) == set(TOOL_CALL_PARSERS)
    assert DEFAULT_TOOL_CALL_PARSER in TOOL_CALL_PARSERS


def test_an_unclosed_hermes_call_is_not_searched_again_at_every_token(monkeypatch):
    """A call opened and never closed: each token used to search the whole call again for
    its closing tag (quadratic in the call's length on the event loop)."""
    scanned = []
    real_find = str.find

    class Text(str):
        def find(self, sub, start=0, *rest):  # what a search for the closing tag has to read
            if sub == HermesToolParser.CLOSE:
                scanned.append(len(self) - start)
            return real_find(self, sub, start, *rest)

    reader = AutoToolCalls(HERMES)
    original = HERMES.split

    def split(text, start, final, seen=0):
        return original(Text(text), start, final, seen)

    monkeypatch.setattr(reader, "parser", type("P", (), {"split": staticmethod(split)})())
    reader.feed('hi <tool_call>{"name": "f", "arguments": {"x": "', False)
    for _ in range(5000):
        reader.feed("ab", False)
    assert max(scanned[-100:]) <= len(HermesToolParser.CLOSE) + 2
    assert sum(scanned) < 200_000  # quadratic: ~25 M
    reader.feed('"}}</tool_call>', True)
    content, calls = reader.message()
    assert content == "hi" and calls[0]["function"]["name"] == "f"
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": "ab" * 5000}


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_hermes_streamed_with_seen_equals_whole(chunk):
    text = ('a <tool_call>{"name": "f", "arguments": {}}</tool_call> b <tool_call'
            '>{"name": "g", "arguments": {"q": "</tool_"}}</tool_call><tool_call>{"bad"</tool_call> end <tool_')
    reader = AutoToolCalls(HERMES)
    for i in range(0, len(text), chunk):
        reader.feed(text[i:i + chunk], i + chunk >= len(text))
    content, calls = reader.message()
    whole = parse(HERMES, text)
    assert [c["function"]["name"] for c in calls] == [c.name for c in whole.calls] == ["f", "g"]
    assert content == whole.content.strip()


def test_a_long_required_call_is_decoded_once(monkeypatch):
    """tool_choice "required": the array's element used to be decoded from its start at
    every token."""
    reader = RequiredToolCalls()
    decodes = []
    real = reader._decoder.raw_decode
    monkeypatch.setattr(reader._decoder, "raw_decode", lambda s, i: decodes.append(i) or real(s, i))
    reader.feed('[{"name": "f", "arguments": {"x": "', False)
    for _ in range(5000):
        reader.feed('a\\"{[', False)
    out = reader.feed('"}}, {"name": "g", "arguments": {}}', False)
    assert [c["function"]["name"] for c in out.tool_calls] == ["f", "g"]
    assert len(decodes) == 2
    assert json.loads(reader.calls[0]["function"]["arguments"]) == {"x": 'a"{[' * 5000}
    assert reader.feed(', 3, {"name": "h", "arguments": {}}]', True).tool_calls == []  # 3 is not a call
