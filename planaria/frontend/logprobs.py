"""Engine ``Logprobs`` (sampled token first, then the top-n) -> the OpenAI and vLLM formats.

Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``;
with ``echo`` the prompt's tokens come first, the first one with ``null`` logprob and top
logprobs (``CompletionLogprobs.add_prompt``), as OpenAI and vLLM send them.
Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{...}]}], "refusal": None}``.
vLLM's ``prompt_logprobs``: ``[None, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]``,
one per prompt token (``prompt_logprobs``).
The completion and chat builders are stateful so streamed chunks continue one another
(text offsets). Pure: token text comes from an injected ``token_text(id) -> str``.
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
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            self._append(out, e)
        return out

    def add_prompt(self, first_token_id: int, entries: list[Logprobs]) -> dict:
        """The echoed prompt: its first token (no logprob: nothing precedes it), then one
        entry per later prompt token (``EngineCoreOutput.prompt_logprobs``)."""
        tok = self._text(first_token_id)
        out: dict = {"tokens": [tok], "token_logprobs": [None], "top_logprobs": [None],
                     "text_offset": [self._offset]}
        self._offset += len(tok)
        for e in entries:
            self._append(out, e)
        return out

    def _append(self, out: dict, e: Logprobs) -> None:
        tok = self._text(e.token_ids[0])
        out["tokens"].append(tok)
        out["token_logprobs"].append(_finite(e.logprobs[0]))
        tops = {self._text(t): _finite(lp)
                for t, lp in zip(e.token_ids[1:1 + self._num_top], e.logprobs[1:1 + self._num_top])}
        tops.setdefault(tok, _finite(e.logprobs[0]))
        out["top_logprobs"].append(tops)
        out["text_offset"].append(self._offset)
        self._offset += len(tok)


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


def prompt_logprobs(token_text: TokenText, entries: list[Logprobs], num_top: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per prompt token a
    dict keyed by token id (a string in JSON): that token with its rank first, then the
    top ``num_top`` with ranks 1..n (a prompt token among them keeps its first place)."""
    out: list[dict | None] = [None]
    for e in entries:
        d = {str(e.token_ids[0]): _logprob(token_text, e.token_ids[0], e.logprobs[0], e.sampled_rank)}
        for rank, (t, lp) in enumerate(zip(e.token_ids[1:1 + num_top], e.logprobs[1:1 + num_top]), start=1):
            d[str(t)] = _logprob(token_text, t, lp, rank)
        out.append(d)
    return out


def _logprob(token_text: TokenText, token_id: int, logprob: float, rank: int) -> dict:
    return {"logprob": _finite(logprob), "rank": rank, "decoded_token": token_text(token_id)}
