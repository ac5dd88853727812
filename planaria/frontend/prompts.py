"""Prompts -> token ids. The structural checks are pure; tokenizing takes a HF tokenizer.

Completions accept ``str | list[str] | list[int] | list[list[int]]`` (a list of strings or
of token lists is a batch: one choice per prompt). Chat messages are flattened to
``{"role", "content": str}`` dicts and rendered with the tokenizer's chat template
(``add_generation_prompt=True`` unless the request says otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planaria.frontend.errors import RequestError
from planaria.frontend.protocol import ChatCompletionRequest

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None  # the prompt as text, when known (echo)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def completion_prompt_inputs(prompt: str | list[Any]) -> list[str | list[int]]:
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
    for i, item in enumerate(items):
        if not item:
            raise RequestError("prompt must not be empty" if len(items) == 1 else f"prompt {i} is empty",
                               param="prompt")
    return items


def check_token_ids(token_ids: list[int], vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise RequestError(f"prompt token id {t} is outside the vocabulary [0, {vocab_size})",
                               param="prompt")


def tokenize_completion(prompt: str | list[Any], tokenizer, vocab_size: int | None) -> list[Prompt]:
    prompts = []
    for item in completion_prompt_inputs(prompt):
        if isinstance(item, str):
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
        out.append(msg)
    if req.continue_final_message and out[-1]["role"] != "assistant":
        raise RequestError("continue_final_message needs the last message to be the assistant's",
                           param="continue_final_message")
    return out


def tokenize_chat(req: ChatCompletionRequest, tokenizer) -> Prompt:
    messages = chat_messages(req)
    continue_final = bool(req.continue_final_message)
    add_generation_prompt = req.add_generation_prompt is not False and not continue_final
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final, **(req.chat_template_kwargs or {}))
    except Exception as exc:  # jinja raises anything (raise_exception in templates, TypeError)
        raise RequestError(f"the chat template could not render these messages: {exc}",
                           param="messages") from exc
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise RequestError("the rendered chat prompt is empty", param="messages")
    return Prompt(list(ids), text)
