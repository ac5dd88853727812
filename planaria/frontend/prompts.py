"""Prompts -> token ids. The structural checks are pure; tokenizing takes a HF tokenizer.

Completions accept ``str | list[str] | list[int] | list[list[int]]`` (a list of strings or
of token lists is a batch: one choice per prompt). Chat messages are flattened to
``{"role", "content": str}`` dicts and rendered with the tokenizer's chat template
(``add_generation_prompt=True`` unless the request says otherwise).

``chat_template_kwargs`` is allow-listed (``CHAT_TEMPLATE_KWARGS``: booleans the common
templates read): anything else, ``chat_template`` above all (a client's own Jinja, which
can loop for hours), is a 400 naming the key. Text longer than ``max_chars`` is refused
before the tokenizer or the template sees it (``limits.RequestLimits.max_chars_per_token``).
These functions block (Jinja, the tokenizer): the server runs them off its event loop
(``frontend.render.PromptRenderer``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from planaria.frontend.errors import RequestError
from planaria.frontend.protocol import ChatCompletionRequest
from planaria.frontend.tool_prompts import assistant_tool_calls, hermes_messages, template_knows_tools

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# chat_template_kwargs a client may set (each a bool); vLLM passes any, including its own
# chat_template, which runs arbitrary Jinja on the server.
CHAT_TEMPLATE_KWARGS = ("add_generation_prompt", "continue_final_message", "enable_thinking")
MAX_TOKEN_ID = 2**31 - 1  # with no vocabulary known: what an engine's int32 tensors hold


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None  # the prompt as text, when known (echo)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def completion_prompt_inputs(prompt: str | list[Any], max_prompts: int | None = None) -> list[str | list[int]]:
    """The batch of prompts in a completions request: each a string or a token id list."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif not prompt:
        raise RequestError("prompt must not be empty", param="prompt")
    elif all(_is_int(t) for t in prompt):
        items = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt):
        items = list(prompt)
    elif all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
        items = [list(p) for p in prompt]
    else:
        raise RequestError("prompt must be a string, a list of strings, a list of token ids, or a "
                           "list of token id lists", param="prompt")
    if max_prompts is not None and len(items) > max_prompts:
        raise RequestError(f"at most {max_prompts} prompts fit in one request, got {len(items)}",
                           param="prompt")
    for i, item in enumerate(items):
        if not item:
            raise RequestError("prompt must not be empty" if len(items) == 1 else f"prompt {i} is empty",
                               param="prompt")
    return items


def check_token_ids(token_ids: list[int], vocab_size: int | None, param: str = "prompt") -> None:
    limit = MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
    for t in token_ids:
        if not 0 <= t < limit:
            raise RequestError(f"{param} token id {t} is outside the vocabulary [0, {limit})", param=param)


def check_chars(text: str, max_chars: int | None, param: str) -> None:
    if max_chars is not None and len(text) > max_chars:
        raise RequestError(f"{param} has {len(text)} characters; this model's context holds at most "
                           f"{max_chars} (refused before tokenizing)", param=param,
                           code="context_length_exceeded")


def tokenize_completion(prompt: str | list[Any], tokenizer, vocab_size: int | None,
                        max_chars: int | None = None, max_prompts: int | None = None) -> list[Prompt]:
    prompts = []
    for item in completion_prompt_inputs(prompt, max_prompts):
        if isinstance(item, str):
            check_chars(item, max_chars, "prompt")
            ids = tokenizer.encode(item, add_special_tokens=True)
            if not ids:
                raise RequestError("the prompt tokenizes to no tokens", param="prompt")
            prompts.append(Prompt(list(ids), item))
        else:
            check_token_ids(item, vocab_size)
            prompts.append(Prompt(item, None))
    return prompts


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The messages as the chat template wants them: role plus text content."""
    if not req.messages:
        raise RequestError("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}",
                               param=f"messages[{i}].role")
        if m.content is None:
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise RequestError(f"messages[{i}].content[{j}]: only text parts are supported, got "
                                       f"type {part.type!r}", param=f"messages[{i}].content[{j}]")
                texts.append(part.text)
            text = "\n".join(texts)
        msg: dict = {"role": m.role, "content": text}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if m.role != "assistant":
                raise RequestError(f"messages[{i}].tool_calls: only assistant messages make tool calls",
                                   param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = assistant_tool_calls(m.tool_calls, f"messages[{i}].tool_calls")
        out.append(msg)
    return out


def chat_template_kwargs(req: ChatCompletionRequest) -> dict[str, bool]:
    """The request's template switches: the top-level fields, then its (allow-listed)
    ``chat_template_kwargs``, which win as in vLLM."""
    kwargs = {"add_generation_prompt": req.add_generation_prompt is not False,
              "continue_final_message": bool(req.continue_final_message)}
    for key, value in (req.chat_template_kwargs or {}).items():
        if key not in CHAT_TEMPLATE_KWARGS:
            raise RequestError(f"chat_template_kwargs.{key} is not allowed; allowed: "
                               f"{', '.join(CHAT_TEMPLATE_KWARGS)}", param=f"chat_template_kwargs.{key}")
        if not isinstance(value, bool):
            raise RequestError(f"chat_template_kwargs.{key} must be a boolean, got {type(value).__name__}",
                               param=f"chat_template_kwargs.{key}")
        kwargs[key] = value
    if kwargs["continue_final_message"]:
        kwargs["add_generation_prompt"] = False
    return kwargs


def tokenize_chat(req: ChatCompletionRequest, tokenizer, max_chars: int | None = None,
                  tools: list[dict] | None = None, add_special_tokens: bool = False) -> Prompt:
    """The chat prompt, rendered with ``tools`` (frontend/tools.py checked them) and the
    tool messages as frontend/tool_prompts.py says; ``add_special_tokens`` adds the
    tokenizer's BOS etc. on top of the template's own (False for generation, as vLLM: the
    template writes them)."""
    kwargs = chat_template_kwargs(req)
    messages = chat_messages(req)
    if kwargs["continue_final_message"] and messages[-1]["role"] != "assistant":
        raise RequestError("continue_final_message needs the last message to be the assistant's",
                           param="continue_final_message")
    tools_text = json.dumps(tools) if tools else ""
    check_chars("".join(m["content"] for m in messages) + tools_text, max_chars, "messages")
    uses_tools = bool(tools) or any(m["role"] == "tool" or "tool_calls" in m for m in messages)
    if uses_tools and not template_knows_tools(tokenizer.chat_template):
        messages, tools = hermes_messages(messages, tools), None
    extra = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs, **extra)
    except Exception as exc:  # jinja raises anything (raise_exception in templates, TypeError)
        raise RequestError(f"the chat template could not render these messages: {exc}",
                           param="messages") from exc
    check_chars(text, max_chars, "messages")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        raise RequestError("the rendered chat prompt is empty", param="messages")
    return Prompt(list(ids), text)


def tokenize_bad_words(words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's ``bad_words`` as token sequences: each word (left-stripped) as it reads at the
    start of a text, and with a leading space as it reads mid-text, the latter only when it
    is a different first token and the same number of tokens (a tokenizer that turns the
    space into a token of its own would otherwise forbid the word's prefix)."""
    out: list[list[int]] = []
    for word in words:
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            continue
        out.append(bare)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out
