"""OpenAI response bodies and stream chunks, as plain dicts. Pure.

Extension field: ``weight_version`` on every completion / chat body and stream chunk, the
version of the engine weights that produced its tokens (for a whole body: its last token;
null before any token). It tells a rolling weight update's old and new answers apart.
vLLM's ``prompt_logprobs`` (frontend/logprobs.py): in each completion choice of a whole
body (frontend/choices.py adds it), at the top of a chat body; null when not asked for.
"""

from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


# -- /v1/completions ---------------------------------------------------------------------
def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      stop_reason: int | str | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def completion(response_id: str, created: int, model: str, choices: list[dict], usage_: dict,
               weight_version: str | None = None) -> dict:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_, "weight_version": weight_version}


def completion_chunk(response_id: str, created: int, model: str, choices: list[dict],
                     usage_: dict | None = None, weight_version: str | None = None) -> dict:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_, "weight_version": weight_version}


# -- /v1/chat/completions ----------------------------------------------------------------
def chat_choice(index: int, text: str | None, logprobs: list[dict] | None, finish_reason: str | None,
                stop_reason: int | str | None = None, tool_calls: list[dict] | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text, "tool_calls": tool_calls or []},
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_completion(response_id: str, created: int, model: str, choices: list[dict], usage_: dict,
                    weight_version: str | None = None, prompt_logprobs: list | None = None) -> dict:
    """``prompt_logprobs``: vLLM's field, at the top of a chat body (one prompt)."""
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_, "weight_version": weight_version,
            "prompt_logprobs": prompt_logprobs}


def chat_chunk_choice(index: int, delta: dict, logprobs: list[dict] | None = None,
                      finish_reason: str | None = None, stop_reason: int | str | None = None) -> dict:
    return {"index": index, "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_chunk(response_id: str, created: int, model: str, choices: list[dict],
               usage_: dict | None = None, weight_version: str | None = None) -> dict:
    return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, "usage": usage_, "weight_version": weight_version}


def model_list(model: str, created: int, max_model_len: int | None, root: str,
               weight_versions: dict[str, str] | None = None) -> dict:
    """``weight_versions``: engine index -> the version it serves; ``weight_version`` is
    their common value (null while the engines differ, e.g. mid rolling update)."""
    versions = weight_versions or {}
    common = set(versions.values())
    return {"object": "list", "data": [{
        "id": model, "object": "model", "created": created, "owned_by": "planaria", "root": root,
        "parent": None, "max_model_len": max_model_len,
        "weight_version": common.pop() if len(common) == 1 else None, "weight_versions": versions}]}
