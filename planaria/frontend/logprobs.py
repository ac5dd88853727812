"""Engine ``Logprobs`` (sampled token first, then the top-n) -> the two OpenAI formats.

Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.
Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{...}]}], "refusal": None}``.
Both builders are stateful so streamed chunks continue one another (text offsets).
Pure: token text comes from an injected ``token_text(id) -> str``.
"""

from __future__ import annotations

import math
from typing import Callable

from planaria.engine.messages import Logprobs

TokenText = Callable[[int], str]


def _finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999.0 is what OpenAI itself sends.
    return x if math.isfinite(x) else -9999.0


class TokenTexts:
    """token id -> its text on its own (as vLLM shows tokens in logprobs), memoized."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class CompletionLogprobs:
    def __init__(self, token_text: TokenText, num_top: int, text_offset: int = 0) -> None:
        self._text = token_text
        self._num_top = num_top
        self._offset = text_offset

    def add(self, entries: list[Logprobs]) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in entries:
            tok = self._text(e.token_ids[0])
            tokens.append(tok)
            token_logprobs.append(_finite(e.logprobs[0]))
            tops = {self._text(t): _finite(lp)
                    for t, lp in zip(e.token_ids[1:1 + self._num_top], e.logprobs[1:1 + self._num_top])}
            tops.setdefault(tok, _finite(e.logprobs[0]))
            top.append(tops)
            offsets.append(self._offset)
            self._offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                "text_offset": offsets}


def merge_completion_logprobs(parts: list[dict]) -> dict:
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in out:
            out[k].extend(p[k])
    return out


class ChatLogprobs:
    def __init__(self, token_text: TokenText, num_top: int) -> None:
        self._text = token_text
        self._num_top = num_top

    def _entry(self, token_id: int, logprob: float) -> dict:
        tok = self._text(token_id)
        return {"token": tok, "logprob": _finite(logprob), "bytes": list(tok.encode("utf-8"))}

    def add(self, entries: list[Logprobs]) -> list[dict]:
        content = []
        for e in entries:
            item = self._entry(e.token_ids[0], e.logprobs[0])
            item["top_logprobs"] = [self._entry(t, lp) for t, lp in
                                    zip(e.token_ids[1:1 + self._num_top], e.logprobs[1:1 + self._num_top])]
            content.append(item)
        return content
