"""OpenAI response bodies and stream chunks, as plain dicts. Pure."""

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


def completion(response_id: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def completion_chunk(response_id: str, created: int, model: str, choices: list[dict],
                     usage_: dict | None = None) -> dict:
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


# -- /v1/chat/completions ----------------------------------------------------------------
def chat_choice(index: int, text: str, logprobs: list[dict] | None, finish_reason: str | None,
                stop_reason: int | str | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_completion(response_id: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_chunk_choice(index: int, delta: dict, logprobs: list[dict] | None = None,
                      finish_reason: str | None = None, stop_reason: int | str | None = None) -> dict:
    return {"index": index, "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_chunk(response_id: str, created: int, model: str, choices: list[dict],
               usage_: dict | None = None) -> dict:
    return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def model_list(model: str, created: int, max_model_len: int | None, root: str) -> dict:
    return {"object": "list", "data": [{
        "id": model, "object": "model", "created": created, "owned_by": "planaria", "root": root,
        "parent": None, "max_model_len": max_model_len}]}
