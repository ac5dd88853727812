"""Request bodies of /v1/completions and /v1/chat/completions as msgspec structs.

Every field the official ``openai`` client can send is declared (so a wrong type is a 400
naming the field); fields this server does not know are ignored, as OpenAI does. vLLM's
extensions (``ignore_eos``, ``top_k``, ``guided_json`` ...) sit beside them. Types are
checked here; values are checked in ``frontend.params`` and ``SamplingParams.validate``.

``decode_completion(body)`` / ``decode_chat(body)`` turn raw bytes into a struct or raise
``RequestError`` with the offending field in ``param``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from planaria.engine.messages import MAX_CACHE_SALT_CHARS
from planaria.frontend.errors import RequestError
from planaria.frontend.limits import INT64_MAX, INT64_MIN, MAX_REQUEST_ID_CHARS, REQUEST_ID_PATTERN

# Every integer a client sends is a signed 64-bit one (the engine socket's msgpack has no
# bigger), so ``seed: 2**70`` is a 400 naming ``seed``, not a failure to encode.
Int = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
# echoed in the X-Request-Id header and every chunk: visible ASCII, bounded (limits.py)
RequestId = Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_CHARS, pattern=REQUEST_ID_PATTERN)]
# a tenant's secret for the prefix cache (vLLM's field): requests with different salts never
# share KV blocks, in an engine or in routing (docs/routing.md)
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _CommonRequest(msgspec.Struct, kw_only=True):
    """Fields both endpoints share: OpenAI sampling fields, then vLLM's extensions."""

    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: Int | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    echo: bool | None = False
    # vLLM extensions
    ignore_eos: bool | None = False
    min_tokens: Int | None = 0
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[Int] | None = None
    allowed_token_ids: list[Int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    prompt_logprobs: Int | None = None  # top-n per prompt position (frontend/logprobs.py)
    priority: Int | None = 0
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    request_id: RequestId | None = None
    cache_salt: CacheSalt | None = None


class CompletionRequest(_CommonRequest, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec allows one array type in a
    # union, so the list's items are checked by ``prompts.completion_prompt_inputs``.
    prompt: str | list[Any]
    best_of: Int | None = None
    logprobs: Int | None = None
    suffix: str | None = None


class TextPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_CommonRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: bool | None = False
    top_logprobs: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    # vLLM extensions
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")
_MISSING_RE = re.compile(r"missing required field `([^`]+)`")


def _param_of(msg: str) -> str | None:
    """The field a msgspec error is about: ``messages[0].role`` from its path and message."""
    path = _PATH_RE.search(msg)
    missing = _MISSING_RE.search(msg)
    parts = [p for p in (path.group(1) if path else None, missing.group(1) if missing else None) if p]
    return ".".join(parts) or None


def _decode(body: bytes, type_: type) -> Any:
    if not body or not body.strip():
        raise RequestError("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except RecursionError as exc:  # the server's depth check comes first; this is the backstop
        raise RequestError("the request body nests arrays/objects too deeply") from exc
    except msgspec.ValidationError as exc:
        msg = str(exc)
        raise RequestError(f"invalid request body: {msg}", param=_param_of(msg)) from exc
    except msgspec.DecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from exc


def decode_completion(body: bytes) -> CompletionRequest:
    return _decode(body, CompletionRequest)


def decode_chat(body: bytes) -> ChatCompletionRequest:
    return _decode(body, ChatCompletionRequest)
