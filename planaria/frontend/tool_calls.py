"""One chat choice's generated text -> content and OpenAI tool calls, streamed or whole.

A ``ToolCallOutput`` is fed the choice's text deltas in order (``feed(text, finished)``)
and answers with what the client may see now: a content fragment and tool-call deltas
(``{"index", "id", "type": "function", "function": {"name", "arguments"}}`` to open a
call, ``{"index", "function": {"arguments": fragment}}`` to extend it). ``message()`` is
the whole answer, built from what was fed: so a non-streamed body and the reassembled
stream are the same by construction. The text it sees is the Generator's, which after an
engine death continues the replayed request's text without a gap; nothing here knows.

- ``AutoToolCalls(parser)``: content streams as it comes, except a tail that may begin a
  call (held by the parser) and whitespace at either end (trimmed: the content between
  calls is mostly newlines); a call is sent whole once its closing tag arrives. Content
  that is only whitespace is null.
- ``NamedToolCall(name)``: the output is the arguments object (a grammar made it so);
  the call opens with the first text and every later delta extends its arguments.
- ``RequiredToolCalls``: the output is a JSON array of ``{"name", "arguments"}``; each
  element is sent as a call once it is complete. An array cut short (``length``) keeps
  its complete calls; with none, the text is the content.

``finish_reason`` is ``"tool_calls"`` when the answer holds a call and the engine stopped
on its own (``"stop"``); ``"length"`` stays ``"length"``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from planaria.frontend.tool_parsers import ParsedToolCall, ToolCallParser, call_from_obj


@dataclass
class ToolDelta:
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


class ToolCallOutput(Protocol):
    num_calls: int

    def feed(self, text: str, finished: bool) -> ToolDelta: ...

    def message(self) -> tuple[str | None, list[dict]]:
        """(content or None, the message's tool_calls)."""
        ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(engine_reason: str | None, num_calls: int) -> str | None:
    return "tool_calls" if num_calls and engine_reason == "stop" else engine_reason


def _opening(index: int, call_id: str, name: str, arguments: str) -> dict:
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _message_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class _WholeCalls:
    """Calls that arrive whole; the message's list kept beside the stream's."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def add(self, call: ParsedToolCall) -> dict:
        call_id = new_call_id()
        self.calls.append(_message_call(call_id, call.name, call.arguments))
        return _opening(len(self.calls) - 1, call_id, call.name, call.arguments)


class AutoToolCalls(_WholeCalls):
    def __init__(self, parser: ToolCallParser) -> None:
        super().__init__()
        self.parser = parser
        self._text = ""
        self._pos = 0  # text before this is split into pieces for good
        self._content = ""  # every content piece so far
        self._start: int | None = None  # the content's first non-space character
        self._end = 0  # just past its last non-space character
        self._sent = 0  # content sent up to here

    def feed(self, text: str, finished: bool) -> ToolDelta:
        seen = len(self._text)
        self._text += text
        pieces, self._pos = self.parser.split(self._text, self._pos, finished, seen)
        out = ToolDelta()
        for piece in pieces:
            if isinstance(piece, ParsedToolCall):
                out.tool_calls.append(self.add(piece))
                continue
            at = len(self._content)
            self._content += piece
            core = piece.strip()
            if core:
                if self._start is None:
                    self._start = at + len(piece) - len(piece.lstrip())
                self._end = at + len(piece.rstrip())
        if self._start is not None and self._end > max(self._sent, self._start):
            out.content = self._content[max(self._sent, self._start):self._end]
            self._sent = self._end
        return out

    def message(self) -> tuple[str | None, list[dict]]:
        content = self._content[self._start:self._end] if self._start is not None else ""
        return content or None, self.calls


class NamedToolCall:
    def __init__(self, name: str) -> None:
        self.name = name
        self.call_id = new_call_id()
        self._arguments = ""
        self._opened = False

    @property
    def num_calls(self) -> int:
        return 1

    def feed(self, text: str, finished: bool) -> ToolDelta:
        self._arguments += text
        if not self._opened and (text or finished):
            self._opened = True
            return ToolDelta(tool_calls=[_opening(0, self.call_id, self.name, text)])
        if text:
            return ToolDelta(tool_calls=[{"index": 0, "function": {"arguments": text}}])
        return ToolDelta()

    def message(self) -> tuple[str | None, list[dict]]:
        return None, [_message_call(self.call_id, self.name, self._arguments)]


class RequiredToolCalls(_WholeCalls):
    """The JSON array is scanned once, character by character in effect (a regex jumps to
    the next quote, backslash or bracket): the depth of the element being written is
    kept, and an element is decoded once, when its brackets close. (Decoding the element
    from its start at every token was quadratic in its length.) An element that is not
    a call object, or not valid JSON, ends the calls: nothing after it is a call."""

    _SPECIAL = re.compile(r'["\\{}\[\]]')

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._pos = 0  # where the next array element (or the array) begins
        self._decoder = json.JSONDecoder()
        self._content: str | None = None
        self._element: int | None = None  # where the element being written begins
        self._scan = 0  # scanned up to here
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._dead = False  # an element was not a call: no more calls

    def feed(self, text: str, finished: bool) -> ToolDelta:
        self._text += text
        out = ToolDelta()
        while not self._dead:
            if self._element is None:
                pos = self._skip(self._pos)
                if pos < len(self._text) and self._text[pos] in "[,":
                    pos = self._skip(pos + 1)
                if pos >= len(self._text):
                    break
                if self._text[pos] not in "{[":
                    self._dead = True  # a string, a number, a stray bracket: not a call
                    break
                self._element, self._scan, self._depth = pos, pos, 0
                self._in_string = self._escaped = False
            end = self._scan_element()
            if end is None:
                break
            call = None
            try:
                obj, end = self._decoder.raw_decode(self._text, self._element)
                call = call_from_obj(obj)
            except (ValueError, RecursionError):
                pass
            self._element = None
            if call is None:
                self._dead = True
                break
            out.tool_calls.append(self.add(call))
            self._pos = end
        if finished and not self.calls and self._text.strip():
            self._content = out.content = self._text
        return out

    def _scan_element(self) -> int | None:
        """Scan on from ``_scan``; the end of the element when its brackets close."""
        text, pos = self._text, self._scan
        if self._escaped and pos < len(text):
            self._escaped, pos = False, pos + 1
        while True:
            m = self._SPECIAL.search(text, pos)
            if m is None:
                self._scan = len(text)
                return None
            ch, pos = m.group(), m.end()
            if self._in_string:
                if ch == "\\":
                    if pos >= len(text):
                        self._escaped, self._scan = True, pos
                        return None
                    pos += 1
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._scan = pos
                    return pos

    def _skip(self, pos: int) -> int:
        while pos < len(self._text) and self._text[pos].isspace():
            pos += 1
        return pos

    def message(self) -> tuple[str | None, list[dict]]:
        return self._content, self.calls
