"""Tools and tool messages in the chat prompt. Pure.

A template that knows tools (its source uses ``tools``: Qwen2.5/3, Hermes, Llama 3.1 ...)
gets them as they are: ``apply_chat_template(messages, tools=...)``, assistant messages
with ``tool_calls`` whose ``arguments`` are objects (the client sends JSON text; the
common templates write ``arguments | tojson``), and ``tool`` messages.

A template that does not (SmolLM2-Instruct's only writes role and content, and would
drop the tools silently) gets the Hermes convention written into the messages, in the
words of Qwen2.5's template: the tool list and the ``<tool_call>`` format appended to
the system message (or a new first one), each assistant call written as a
``<tool_call>`` block after its content, and ``tool`` results as a user turn of
``<tool_response>`` blocks (consecutive results in one turn). The ``hermes`` parser
(frontend/tool_parsers.py) reads what a model writes back in that format.
"""

from __future__ import annotations

import json
from typing import Any

from planaria.frontend.errors import RequestError

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_knows_tools(template: str | dict | None) -> bool:
    """Whether a chat template (or any of a tokenizer's named ones) reads ``tools``."""
    if isinstance(template, dict):
        return any(template_knows_tools(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def assistant_tool_calls(raw: list[dict[str, Any]], at: str) -> list[dict]:
    """An assistant message's ``tool_calls`` as templates want them: ``{"id", "type":
    "function", "function": {"name", "arguments": object}}`` (arguments that are not a
    JSON object's text are kept as text). ``at`` is the field's name for errors."""
    calls = []
    for j, call in enumerate(raw):
        where = f"{at}[{j}]"
        if call.get("type", "function") != "function":
            raise RequestError(f"{where}.type must be 'function', got {call.get('type')!r:.80}", param=f"{where}.type")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}.function must be an object with a string name", param=f"{where}.function")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                decoded = json.loads(args)
            except (ValueError, RecursionError):
                decoded = None
            args = decoded if isinstance(decoded, dict) else args
        elif not isinstance(args, dict):
            raise RequestError(f"{where}.function.arguments must be a JSON object's text",
                               param=f"{where}.function.arguments")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise RequestError(f"{where}.id must be a string", param=f"{where}.id")
        calls.append({"id": call_id or "", "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return calls


def _call_block(call: dict) -> str:
    fn = call["function"]
    args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"], ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` with the tools, calls and results written as Hermes text, for a
    template that knows only role and content."""
    out: list[dict] = []
    if tools:
        block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            first = messages[0]
            out.append({**first, "content": f"{first['content']}\n\n{block}" if first["content"] else block})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            parts = ([m["content"]] if m["content"] else []) + [_call_block(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "tool_responses"} for m in out]
