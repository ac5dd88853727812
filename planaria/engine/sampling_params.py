"""Per-request sampling parameters, in the convention vLLM users know.

A msgspec struct so the same object travels on the wire (engine/messages.py) without
pickle. ``validate`` is the one place a request's parameters are checked; a bad value
raises ``InvalidRequestError`` for that request only.

``stop_token_ids`` is a frozenset (the scheduler tests every sampled token against it);
on the wire it is an array as before, and a list given to the constructor is converted
once, in ``__post_init__``.
"""

from __future__ import annotations

import math

import msgspec

from planaria.engine.errors import InvalidRequestError

_INT_MAX = 2**31 - 1


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token
    # vLLM's prompt logprobs: for each prompt position but the first, the logprob and rank
    # of that prompt token and the top-n (EngineCoreOutput.prompt_logprobs, engine/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.stop_token_ids, frozenset):
            try:
                self.stop_token_ids = frozenset(self.stop_token_ids)
            except TypeError:
                pass  # not a collection of hashables: validate() names it

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int | None = None, max_logprobs: int = 20) -> None:
        """Raise InvalidRequestError naming the first bad field."""

        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n != 1:
            bad(f"n must be 1, got {self.n!r}")
        if self.max_tokens is not None:
            if not is_int(self.max_tokens):
                bad(f"max_tokens must be an integer, got {type(self.max_tokens).__name__}")
            if self.max_tokens <= 0:
                bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)):
                bad(f"{name} must be a number, got {type(getattr(self, name)).__name__}")
            if not math.isfinite(getattr(self, name)):
                bad(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not is_int(self.top_k) or self.top_k < -1:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and not is_int(self.seed):
            bad(f"seed must be an integer, got {type(self.seed).__name__}")
        if self.logprobs is not None:
            if not is_int(self.logprobs) or not 0 <= self.logprobs <= max_logprobs:
                bad(f"logprobs must be an integer in [0, {max_logprobs}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None:
            if not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= max_logprobs:
                bad(f"prompt_logprobs must be an integer in [0, {max_logprobs}], got {self.prompt_logprobs!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, frozenset) or not all(is_int(t) for t in self.stop_token_ids):
            bad("stop_token_ids must be a list of integers")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    bad(f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
