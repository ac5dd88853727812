"""``tools`` and ``tool_choice`` of a chat request -> a ``ToolPlan``. Pure (llguidance
checks the schemas of the forced modes; no tokenizer).

What each ``tool_choice`` does (OpenAI's default: ``"auto"`` with tools, else ``"none"``):

- ``"none"``: no tool calls; the tools are still shown to the template (vLLM does the
  same), the output is plain content.
- ``"auto"``: the model writes freely; the server's tool-call parser
  (``--tool-call-parser``, frontend/tool_parsers.py) finds the calls in its text. With the
  parser switched off (``none``) an explicit ``"auto"`` is a 400 and the default is ``"none"``;
  with no tools, ``"auto"`` is ``"none"``.
- ``{"type": "function", "function": {"name": N}}``: the output is constrained to a JSON
  object valid against N's ``parameters`` (structured output, as vLLM does) and returned
  as one call of N.
- ``"required"``: the output is constrained to a JSON array of one or more
  ``{"name": <a tool's name>, "arguments": <its parameters>}`` (one at most with
  ``parallel_tool_calls: false``), each returned as a call.

A forced choice cannot be combined with ``response_format`` (non-text) or ``guided_*``:
both would set the grammar (400 naming ``tool_choice``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from planaria.frontend.errors import RequestError
from planaria.frontend.protocol import ChatCompletionRequest
from planaria.frontend.tool_calls import AutoToolCalls, NamedToolCall, RequiredToolCalls, ToolCallOutput
from planaria.frontend.tool_parsers import ToolCallParser

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MODES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """What the server does with a request's tools; ``tools`` as the template wants them."""

    mode: str = "none"  # "none" | "auto" | "required" | "named"
    tools: list[dict] = field(default_factory=list)
    name: str | None = None  # the forced function ("named")
    parallel: bool = True
    parser: ToolCallParser | None = None

    @property
    def template_tools(self) -> list[dict] | None:
        return self.tools or None

    def structured_output(self, requested: dict | None) -> dict | None:
        """The engine's grammar: the forced modes' own, else the request's."""
        if self.mode not in ("named", "required"):
            return requested
        if requested is not None:
            raise RequestError(f"tool_choice {self._choice_text()} sets the output's grammar; it cannot be "
                               "combined with response_format or guided_* fields", param="tool_choice")
        return {"type": "json_schema", "value": json.dumps(self.schema())}

    def schema(self) -> dict:
        """The JSON schema a forced choice's output follows."""
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}
        if self.mode == "named":
            return by_name[self.name]
        item = {"anyOf": [{"type": "object", "properties": {"name": {"enum": [name]}, "arguments": params},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for name, params in by_name.items()]}
        schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def output(self) -> Callable[[], ToolCallOutput] | None:
        """A factory of the per-choice output reader, or None: plain content."""
        if self.mode == "auto":
            parser = self.parser
            return lambda: AutoToolCalls(parser)
        if self.mode == "named":
            name = self.name
            return lambda: NamedToolCall(name)
        if self.mode == "required":
            return RequiredToolCalls
        return None

    def _choice_text(self) -> str:
        return f"function {self.name!r}" if self.mode == "named" else repr(self.mode)


def _check_parameters(params: Any, param: str) -> dict:
    """A function's ``parameters``: a JSON schema of an object (missing: no arguments)."""
    if params is None:
        return dict(EMPTY_PARAMETERS)
    if not isinstance(params, dict):
        raise RequestError(f"{param} must be a JSON schema (an object), got {type(params).__name__}", param=param)
    if params.get("type", "object") != "object":
        raise RequestError(f"{param} must describe an object (type \"object\"), got type {params['type']!r}",
                           param=param)
    props = params.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        raise RequestError(f"{param}.properties must map names to schemas (objects)", param=f"{param}.properties")
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise RequestError(f"{param}.required must be a list of property names", param=f"{param}.required")
    return params


def check_tools(raw: list[dict[str, Any]]) -> list[dict]:
    """The request's tools, checked, as ``{"type": "function", "function": {name,
    description?, parameters}}``; RequestError names the bad field."""
    tools, names = [], set()
    for i, tool in enumerate(raw):
        at = f"tools[{i}]"
        if tool.get("type") != "function":
            raise RequestError(f"{at}.type must be 'function', got {tool.get('type')!r}", param=f"{at}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"{at}.function must be an object with a name", param=f"{at}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise RequestError(f"{at}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}",
                               param=f"{at}.function.name")
        if name in names:
            raise RequestError(f"{at}.function.name {name!r} is given twice", param=f"{at}.function.name")
        names.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestError(f"{at}.function.description must be a string", param=f"{at}.function.description")
        out: dict[str, Any] = {"name": name}
        if description is not None:
            out["description"] = description
        out["parameters"] = _check_parameters(fn.get("parameters"), f"{at}.function.parameters")
        tools.append({"type": "function", "function": out})
    return tools


def check_schema_compiles(schema: dict, param: str) -> None:
    """A forced choice's schema must compile to a grammar: a 400 naming ``param`` here,
    rather than the engine's nameless one."""
    # deferred: llguidance (~50 ms) only for a forced tool choice. Its schema compiler
    # recurses natively: the body's depth limit (32) keeps it shallow.
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))
    except (ValueError, TypeError, RuntimeError) as exc:
        error = str(exc)
    if error:
        raise RequestError(f"{param} is not a JSON schema this server can enforce: {error}", param=param)


def tool_plan(req: ChatCompletionRequest, parser: ToolCallParser | None) -> ToolPlan:
    """The request's ``ToolPlan``; RequestError names the bad field."""
    if req.functions:
        raise RequestError("functions is deprecated and not supported; send tools", param="functions")
    if req.function_call is not None:
        raise RequestError("function_call is deprecated and not supported; send tool_choice",
                           param="function_call")
    tools = check_tools(req.tools or [])
    choice = req.tool_choice
    plan = ToolPlan(tools=tools, parallel=req.parallel_tool_calls is not False, parser=parser)
    if choice is None:
        plan.mode = "auto" if tools and parser is not None else "none"
        return plan
    if isinstance(choice, str):
        if choice not in MODES:
            raise RequestError(f"tool_choice must be one of {', '.join(MODES)} or a function, got {choice!r:.80}",
                               param="tool_choice")
        plan.mode = choice
    else:
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                               '"function": {"name": ...}}', param="tool_choice")
        plan.mode, plan.name = "named", name
    if plan.mode == "auto" and not tools:
        plan.mode = "none"  # nothing to call (clients send "auto" with no tools; OpenAI's default is "none")
    if plan.mode == "auto" and parser is None:
        raise RequestError('tool_choice "auto" needs a tool-call parser; this server runs with '
                           "--tool-call-parser none", param="tool_choice")
    if plan.mode in ("required", "named") and not tools:
        raise RequestError(f"tool_choice {plan._choice_text()} needs tools", param="tool_choice")
    if plan.mode == "named":
        index = next((i for i, t in enumerate(tools) if t["function"]["name"] == plan.name), None)
        if index is None:
            raise RequestError(f"tool_choice names function {plan.name!r:.80}, which is not in tools",
                               param="tool_choice")
        check_schema_compiles(plan.schema(), f"tools[{index}].function.parameters")
    elif plan.mode == "required":
        for i, t in enumerate(tools):
            check_schema_compiles(t["function"]["parameters"], f"tools[{i}].function.parameters")
    return plan
