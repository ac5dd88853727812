"""Tool-call parsers: a model's text -> content and tool calls, for ``tool_choice: "auto"``.

Models write calls in their own convention; a parser knows one. The frontend flag
``--tool-call-parser NAME`` picks one from ``TOOL_CALL_PARSERS`` (as ``vllm serve
--tool-call-parser``); ``register_tool_parser`` adds another. Pure: no tokenizer.

A parser's one method, ``split(text, start, final)``, cuts ``text[start:]`` into content
pieces and calls, in order, up to the point where the text could still turn into
something else (an unclosed call, or a tail that may begin a call's opening tag), and
says where that point is. With ``final`` all the text is accounted for. Streaming calls
it with the whole text so far (after an engine death the replayed request's text simply
continues it) from where the last call stopped; a whole answer is one call with
``final``; both see the same pieces, so a stream reassembles to the non-streamed answer.

Hermes (``hermes``; Qwen2.5/3, Hermes, and the prompt frontend/tool_prompts.py writes for
templates without tools): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
any number of them, text around them is content. A block whose JSON does not parse, or
lacks a string ``name`` or an object ``arguments``, is content, tags and all. An unclosed
last block is a call if its JSON is whole (a model that stopped at its end-of-turn token
without the closing tag), else content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from planaria.common.tool_parser_names import DEFAULT_TOOL_CALL_PARSER


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text


Piece = str | ParsedToolCall  # content text, or a call


@dataclass
class ParsedOutput:
    content: str  # every content piece, joined
    calls: list[ParsedToolCall]


class ToolCallParser(Protocol):
    def split(self, text: str, start: int, final: bool, seen: int = 0) -> tuple[list[Piece], int]:
        """The pieces of ``text[start:end]`` and ``end``; ``text[end:]`` is held back (only
        when not ``final``) because it may still become part of a call. ``seen``: the
        length of the text at the previous call (which returned ``start``); the text
        before it is unchanged, so a search for a marker may resume near it instead of
        scanning the held-back part again (streaming stays linear in the output)."""
        ...


def parse(parser: ToolCallParser, text: str) -> ParsedOutput:
    """A whole output's content and calls."""
    pieces, _ = parser.split(text, 0, True)
    return ParsedOutput("".join(p for p in pieces if isinstance(p, str)),
                        [p for p in pieces if isinstance(p, ParsedToolCall)])


def call_from_json(text: str) -> ParsedToolCall | None:
    """``{"name": str, "arguments": object}`` (or ``"parameters"``, or arguments as JSON
    text) -> a call; anything else -> None."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError; RecursionError: [[[[...
        return None
    return call_from_obj(obj)


def call_from_obj(obj: object) -> ParsedToolCall | None:
    """A decoded call object -> a call; not one -> None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def partial_suffix(text: str, start: int, marker: str) -> int:
    """How many characters at the end of ``text[start:]`` begin ``marker`` (a proper prefix)."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class HermesToolParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def split(self, text: str, start: int, final: bool, seen: int = 0) -> tuple[list[Piece], int]:
        pieces: list[Piece] = []
        pos = start
        while True:
            # a marker that ends past `seen` begins at most len(marker) - 1 before it
            if pos == start and not text.startswith(self.OPEN, pos):
                open_at = text.find(self.OPEN, max(pos, seen - len(self.OPEN) + 1))
            else:
                open_at = text.find(self.OPEN, pos)
            if open_at < 0:
                end = len(text) if final else len(text) - partial_suffix(text, pos, self.OPEN)
                if end > pos:
                    pieces.append(text[pos:end])
                return pieces, end
            if open_at > pos:
                pieces.append(text[pos:open_at])
            body_at = open_at + len(self.OPEN)
            resume = seen - len(self.CLOSE) + 1 if open_at == start else 0
            close_at = text.find(self.CLOSE, max(body_at, resume))
            if close_at < 0:
                if not final:
                    return pieces, open_at
                call = call_from_json(text[body_at:])
                pieces.append(call if call is not None else text[open_at:])
                return pieces, len(text)
            after = close_at + len(self.CLOSE)
            call = call_from_json(text[body_at:close_at])
            pieces.append(call if call is not None else text[open_at:after])
            pos = after


TOOL_CALL_PARSERS: dict[str, type] = {"hermes": HermesToolParser}  # keys: common/tool_parser_names.py


def register_tool_parser(name: str, cls: type) -> None:
    """Make ``--tool-call-parser name`` build ``cls()`` (a ``ToolCallParser``)."""
    TOOL_CALL_PARSERS[name] = cls


def get_tool_parser(name: str) -> ToolCallParser:
    try:
        return TOOL_CALL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_CALL_PARSERS))}") \
            from None
