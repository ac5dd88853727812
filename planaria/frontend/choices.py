"""One response's choices, as the two generation endpoints render them: ``Choice`` collects
a choice's deltas; ``CompletionRender`` and ``ChatRender`` turn each ``GenerationDelta``
into a stream chunk's choice and, at the end, into the whole body's. Pure: no sockets.

Logprobs (frontend/logprobs.py): a completion with ``echo`` and ``logprobs`` shows the
prompt's tokens first (their logprobs come with the first token's delta); vLLM's
``prompt_logprobs`` field sits in each completion choice, and at the top of a chat body
(a chat has one prompt), as vLLM places them; it is null when not asked for.

With tools in effect (frontend/tools.py) a chat choice reads tool calls out of its text
as it streams (frontend/tool_calls.py); the whole body is what its deltas fed it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from planaria.frontend import responses as R
from planaria.frontend.generation import GenerationDelta
from planaria.frontend.logprobs import ChatLogprobs, CompletionLogprobs, merge_completion_logprobs, prompt_logprobs
from planaria.frontend.tool_calls import ToolCallOutput
from planaria.frontend.tool_calls import finish_reason as tool_finish_reason


@dataclass
class Choice:
    index: int
    num_prompt_tokens: int
    prefix: str = ""  # echo: the prompt text, sent before the first delta
    first_prompt_token: int = 0  # echo with logprobs: the token that has no logprob
    texts: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    lp_builder: object = None
    prompt: int = 0  # which prompt of the request (completions take several)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    tool_calls: ToolCallOutput | None = None  # chat with tools in effect: reads calls from the text
    counts_prompt: bool = True  # n > 1: only a prompt's first choice counts its tokens in usage
    cumulative_logprob: float = 0.0  # of the sampled tokens, when they came with logprobs (best_of)

    def take(self, d: GenerationDelta) -> str:
        text, self.prefix = self.prefix + d.text, ""
        if d.logprobs:
            self.cumulative_logprob += sum(lp.logprobs[0] for lp in d.logprobs if lp.logprobs)
        self.texts.append(text)
        self.num_output_tokens = d.num_output_tokens
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
        return text


def best_choices(choices: list[Choice], n: int, best_of: int) -> list[Choice]:
    """``best_of > n``: of each prompt's ``best_of`` choices (consecutive), the ``n`` with
    the highest cumulative logprob, renumbered ``i * n + rank`` (ties: the lower index)."""
    out = []
    for i in range(len(choices) // best_of):
        group = choices[i * best_of:(i + 1) * best_of]
        ranked = sorted(group, key=lambda c: (-c.cumulative_logprob, c.index))[:n]
        for rank, c in enumerate(ranked):
            c.index = i * n + rank
            out.append(c)
    return out


class _Render:
    best_of: tuple[int, int] | None = None  # (n, best_of) when best_of > n: the body keeps the best

    def __init__(self, choices: list[Choice], token_text, num_prompt_top: int | None) -> None:
        self.choices = choices
        self.token_text = token_text
        self.num_prompt_top = num_prompt_top  # vLLM's prompt_logprobs field; None: not shown
        # per prompt: the engine's entries (one sibling computes them), then the field built
        # from them once (build_prompt_logprobs, off the event loop) and shared by its choices
        self._prompt_entries: dict[int, list] = {}
        self._prompt_logprobs: dict[int, list] = {}

    def _take_prompt_logprobs(self, c: Choice, d: GenerationDelta) -> None:
        if d.prompt_logprobs is not None and self.num_prompt_top is not None:
            self._prompt_entries.setdefault(c.prompt, d.prompt_logprobs)

    def build_prompt_logprobs(self) -> None:
        """vLLM's ``prompt_logprobs`` field of each prompt, from its entries: once per prompt
        (its n choices share the list), called off the event loop before the body is built
        (a long prompt's entries make tens of thousands of dicts)."""
        for i, entries in self._prompt_entries.items():
            if i not in self._prompt_logprobs:
                self._prompt_logprobs[i] = prompt_logprobs(self.token_text, entries, self.num_prompt_top)

    def prompt_logprobs_of(self, c: Choice) -> list | None:
        return self._prompt_logprobs.get(c.prompt)


class CompletionRender(_Render):
    chunk = staticmethod(R.completion_chunk)

    def __init__(self, choices: list[Choice], token_text, num_top: int | None, *, echo: bool = False,
                 num_prompt_top: int | None = None) -> None:
        super().__init__(choices, token_text, num_prompt_top)
        # echo with logprobs: the prompt's tokens carry logprobs too, offsets count from 0
        self.echo_logprobs = echo and num_top is not None
        for c in choices:
            if num_top is not None:
                offset = 0 if self.echo_logprobs else len(c.prefix)
                c.lp_builder = CompletionLogprobs(token_text, num_top, text_offset=offset)

    def first_chunks(self) -> list[list[dict]]:
        return []

    def delta(self, c: Choice, d: GenerationDelta) -> dict | None:
        text = c.take(d)
        self._take_prompt_logprobs(c, d)
        lp = None
        if c.lp_builder is not None:
            parts = []  # the echoed prompt's first (its offsets come first)
            if self.echo_logprobs and d.prompt_logprobs is not None:
                parts.append(c.lp_builder.add_prompt(c.first_prompt_token, d.prompt_logprobs))
            parts.append(c.lp_builder.add(d.logprobs or []))
            lp = merge_completion_logprobs(parts) if len(parts) > 1 else parts[0]
            c.logprobs.append(lp)
        if not text and d.finish_reason is None and not (lp and lp["tokens"]):
            return None
        return R.completion_choice(c.index, text, lp, d.finish_reason, d.stop_reason)

    def final(self, c: Choice) -> dict:
        lp = merge_completion_logprobs(c.logprobs) if c.lp_builder is not None else None
        choice = R.completion_choice(c.index, "".join(c.texts), lp, c.finish_reason, c.stop_reason)
        choice["prompt_logprobs"] = self.prompt_logprobs_of(c)
        return choice

    def body(self, response_id: str, created: int, model: str, choices: list[dict], usage: dict,
             weight_version: str | None) -> dict:
        return R.completion(response_id, created, model, choices, usage, weight_version)


class ChatRender(_Render):
    chunk = staticmethod(R.chat_chunk)

    def __init__(self, choices: list[Choice], token_text, num_top: int | None, *,
                 num_prompt_top: int | None = None,
                 tool_calls: Callable[[], ToolCallOutput] | None = None) -> None:
        super().__init__(choices, token_text, num_prompt_top)
        for c in choices:
            if num_top is not None:
                c.lp_builder = ChatLogprobs(token_text, num_top)
            if tool_calls is not None:
                c.tool_calls = tool_calls()

    def first_chunks(self) -> list[list[dict]]:
        return [[R.chat_chunk_choice(c.index, {"role": "assistant", "content": ""})] for c in self.choices]

    def delta(self, c: Choice, d: GenerationDelta) -> dict | None:
        text = c.take(d)
        self._take_prompt_logprobs(c, d)
        lp = c.lp_builder.add(d.logprobs or []) if c.lp_builder is not None else None
        if lp:
            c.logprobs.extend(lp)
        finish = d.finish_reason
        if c.tool_calls is not None:
            out = c.tool_calls.feed(text, finish is not None)
            delta = ({"content": out.content} if out.content else {}) | (
                {"tool_calls": out.tool_calls} if out.tool_calls else {})
            finish = tool_finish_reason(finish, c.tool_calls.num_calls)
        else:
            delta = {"content": text} if text or finish is None else {}
        if not delta and finish is None and not lp:
            return None
        return R.chat_chunk_choice(c.index, delta, lp, finish, d.stop_reason)

    def final(self, c: Choice) -> dict:
        lp = c.logprobs if c.lp_builder is not None else None
        if c.tool_calls is None:
            return R.chat_choice(c.index, "".join(c.texts), lp, c.finish_reason, c.stop_reason)
        content, calls = c.tool_calls.message()  # what the deltas fed it: a stream's sum
        return R.chat_choice(c.index, content, lp, tool_finish_reason(c.finish_reason, len(calls)),
                             c.stop_reason, calls)

    def body(self, response_id: str, created: int, model: str, choices: list[dict], usage: dict,
             weight_version: str | None) -> dict:
        return R.chat_completion(response_id, created, model, choices, usage, weight_version,
                                 prompt_logprobs=self._prompt_logprobs.get(0))
