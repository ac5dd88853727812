"""Per-request sampling parameters, in the convention vLLM users know.

A msgspec struct so the same object travels on the wire (engine/messages.py) without
pickle. ``validate`` is the one place a request's parameters are checked; a bad value
raises ``InvalidRequestError`` for that request only.

``stop_token_ids`` is a frozenset (the scheduler tests every sampled token against it);
on the wire it is an array as before, and a list given to the constructor is converted
once, in ``__post_init__``.

Token controls (applied by the sampler after the penalties, engine/logit_controls.py):
``logit_bias`` maps a token id to a bias in [-100, 100] (the frontend clamps OpenAI's
values into that range); ``allowed_token_ids`` limits sampling to those ids;
``bad_words_token_ids`` are token sequences (the frontend tokenizes vLLM's ``bad_words``):
a sequence's last token is forbidden whenever the tokens before it are the last tokens
generated, so a one-token sequence is always forbidden.
"""

from __future__ import annotations

import math

import msgspec

from planaria.engine.errors import InvalidRequestError

_INT_MAX = 2**31 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's and vLLM's bound on a bias's magnitude
# Bounds an engine enforces whoever sends the request (the frontend's are tighter):
# every step checks each sequence against the request's output tail.
MAX_BAD_WORD_SEQUENCES = 1024
MAX_BAD_WORD_TOKENS = 256


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
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None

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

    @property
    def has_logit_controls(self) -> bool:
        """A logit bias, an allow-list or bad words: the sampler's controls step runs."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

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
        self._validate_logit_controls(vocab_size, bad, is_int, is_num)

    def _validate_logit_controls(self, vocab_size: int | None, bad, is_int, is_num) -> None:
        limit = _INT_MAX + 1 if vocab_size is None else vocab_size

        def check_ids(name: str, ids: object, what: str = "a list of integers") -> None:
            if not isinstance(ids, list) or not all(is_int(t) for t in ids):
                bad(f"{name} must be {what}")
            for t in ids:
                if not 0 <= t < limit:
                    bad(f"{name} token id {t} is outside the vocabulary [0, {limit})")

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias must be a map of token id to bias")
            check_ids("logit_bias", list(self.logit_bias), "a map of token id (an integer) to bias")
            for t, b in self.logit_bias.items():
                if not is_num(b) or not math.isfinite(b) or abs(b) > MAX_LOGIT_BIAS:
                    bad(f"logit_bias of token {t} must be a number in [-100, 100], got {b!r}")
        if self.allowed_token_ids is not None:
            check_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                bad("allowed_token_ids must not be empty")
            if len(self.allowed_token_ids) > limit:
                bad(f"allowed_token_ids holds at most {limit} ids (the vocabulary), "
                    f"got {len(self.allowed_token_ids)}")
        if self.bad_words_token_ids is not None:
            words = self.bad_words_token_ids
            if not isinstance(words, list) or len(words) > MAX_BAD_WORD_SEQUENCES:
                bad(f"bad_words_token_ids must be a list of at most {MAX_BAD_WORD_SEQUENCES} token id lists")
            for w in words:
                check_ids("bad_words_token_ids", w, "a list of token id lists")
                if not 0 < len(w) <= MAX_BAD_WORD_TOKENS:
                    bad(f"bad_words_token_ids sequences hold 1 to {MAX_BAD_WORD_TOKENS} token ids each, "
                        f"got {len(w)}")


def sibling_seed(seed: int | None, j: int) -> int | None:
    """n > 1: sibling ``j``'s seed is ``seed + j`` (as vLLM seeds a parent request's
    children), wrapped into the signed 64-bit range; None stays None (unseeded)."""
    if seed is None or j == 0:
        return seed
    return (seed + j + 2**63) % 2**64 - 2**63


def sibling_params(params: SamplingParams, j: int) -> SamplingParams:
    """Sibling ``j``'s parameters: ``params`` with ``sibling_seed`` (itself for j = 0)."""
    return params if j == 0 else msgspec.structs.replace(params, seed=sibling_seed(params.seed, j))
