"""What one request may ask for, and the HTTP server's own bounds. Pure.

``RequestLimits`` bounds a request's body (checked in ``frontend.params``,
``frontend.prompts``, ``frontend.embeddings``); every breach is a 400 naming the field
(``param``). ``ServerLimits`` holds the HTTP-level settings ``python -m
planaria.frontend.main`` takes as flags (``planaria serve`` passes them on).

Defaults, and why:

- ``max_json_depth`` 32: an OpenAI body nests at most ~6 levels (a JSON schema a few
  more); deep nesting only costs recursion (msgspec and ``json.dumps`` are recursive).
- ``max_stop`` 16 strings of at most ``max_stop_chars`` 256 characters: every generated
  token is checked against each (OpenAI allows 4).
- ``max_stop_token_ids`` 1024.
- ``max_logit_bias`` 1024 entries (each is a scatter per step; OpenAI's clients bias a
  few dozen tokens at most). ``allowed_token_ids`` holds at most the vocabulary's size.
- ``max_bad_words`` 64 words of at most ``max_bad_word_chars`` 256 characters: each
  becomes up to two token sequences, checked against the output at every step.
- ``max_prompts`` 64 prompts in one /v1/completions batch; ``max_embedding_inputs``
  256 inputs in one /v1/embeddings call (each is one engine request).
- ``max_n`` 16: ``n`` and ``best_of``, the choices generated per prompt (each is one
  engine request); ``max_choices`` 128 in one request, prompts times choices.
- ``max_chars_per_token`` 16: a text longer than 16 characters per token of the context
  (``max_model_len``) cannot fit in any tokenizer worth serving, so it is refused before
  the tokenizer runs (it would only burn CPU to be refused afterwards).
- integers: every integer field is a signed 64-bit value (msgpack's range on the engine
  socket); token ids must also be inside the vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import accumulate

from planaria.frontend.errors import RequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class RequestLimits:
    max_json_depth: int = 32
    max_stop: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    max_bad_words: int = 64
    max_bad_word_chars: int = 256
    max_prompts: int = 64
    max_embedding_inputs: int = 256
    max_chars_per_token: int = 16
    max_n: int = 16
    max_choices: int = 128

    def max_prompt_chars(self, max_model_len: int) -> int:
        return self.max_chars_per_token * max_model_len


@dataclass(frozen=True)
class ServerLimits:
    """HTTP-level bounds (flags of ``planaria.frontend.main``; defaults documented there
    and in docs/http_api.md)."""

    max_body_bytes: int = 4 * 2**20
    body_read_timeout_s: float = 30.0
    # Longer than the idle expiry of common clients (httpx 5 s, aiohttp 15 s), as aiohttp's and
    # nginx's 75 s: the client closes an idle connection first, so a request sent on one is
    # never raced by the server's close ("Can not write request body" / connection reset).
    keep_alive_timeout_s: float = 75.0
    max_connections: int = 1024
    max_inflight_requests: int = 512
    request_timeout_s: float = 600.0
    render_timeout_s: float = 20.0
    render_threads: int = 4
    # a request that finds no engine serving (all restarting), or whose engine died, waits
    # this long for one before its 503
    engine_wait_s: float = 30.0
    api_key: str | None = None
    api_key_protects_metrics: bool = False


_STRING_RE = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def check_json_depth(body: bytes, max_depth: int) -> None:
    """RequestError when ``body``'s arrays/objects nest deeper than ``max_depth``.

    A scan of the raw bytes, before any decoder recurses into them: strings are cut out
    (a regex, in C), the brackets kept, and the depth is their running sum. Bodies with
    few brackets (nearly all) take the first line only.
    """
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return
    brackets = _STRING_RE.sub(b"", body).translate(None, _NOT_BRACKETS)
    if brackets and max(accumulate(map(_STEP.__getitem__, brackets))) > max_depth:
        raise RequestError(f"the request body nests arrays/objects deeper than {max_depth} levels")
