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
- ``max_prompt_logprob_values`` 262144: prompt logprobs return (prompt tokens - 1) x
  (top-n + 1) numbers per prompt (and per choice with ``echo`` and ``logprobs``), each a
  dict in the body: 8k prompt tokens at top 20 is 172k. Bounds the engine's output message,
  the frontend's memory and the time to build the body.
- integers: every integer field is a signed 64-bit value (msgpack's range on the engine
  socket); token ids must also be inside the vocabulary.
- ``request_id``: at most ``MAX_REQUEST_ID_CHARS`` 256 visible ASCII characters (``!`` to
  ``~``: no space, CR, LF or other control character). It becomes the response's ``id``
  and its ``X-Request-Id`` header: a CR/LF there failed the response after the engine had
  done the work, and a long one is repeated in every SSE chunk. Checked as the body is
  decoded (``frontend.protocol``), before any work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planaria.frontend.errors import RequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_REQUEST_ID_CHARS = 256
# \A and \Z, not ^ and $: "$" also matches before a final newline
REQUEST_ID_PATTERN = r"\A[!-~]*\Z"


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
    max_prompt_logprob_values: int = 262144

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
    # A client's share of max_connections: one address cannot fill every slot (a browser
    # opens 6 per host, a connection pool 10 to 100). 0 is off, for a reverse proxy in front
    # (every client then has the proxy's address).
    max_connections_per_client: int = 64
    # From a connection's accept, and from the first byte of each later request, to the
    # end of its request head: a client on any link sends its few hundred bytes of head at
    # once, and connections that never finish one would hold max_connections' slots.
    header_read_timeout_s: float = 10.0
    max_inflight_requests: int = 512
    request_timeout_s: float = 600.0
    # one SSE write may wait this long for a client that stopped reading (buffers full);
    # then the request is aborted and its slot freed (frontend/serving.py SSEWriter)
    write_timeout_s: float = 30.0
    render_timeout_s: float = 20.0
    render_threads: int = 4
    # a request that finds no engine serving (all restarting), or whose engine died, waits
    # this long for one before its 503
    engine_wait_s: float = 30.0
    api_key: str | None = None
    # who may set a request's priority (frontend/admission.py): everyone, or callers whose
    # bearer token is this key
    allow_client_priority: bool = False
    priority_key: str | None = None
    api_key_protects_metrics: bool = False


# The depth scan reads the body in slices of this many bytes: its numpy temporaries (about
# 20 bytes per body byte) stay near a MiB whatever the body's size.
_SCAN_CHUNK_BYTES = 2**16
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def check_json_depth(body: bytes, max_depth: int) -> None:
    """RequestError when ``body``'s arrays/objects nest deeper than ``max_depth``.

    Bodies with few brackets (nearly all) take the first line only; the others get
    ``json_depth``, a scan of the raw bytes before any decoder recurses into them.
    """
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return
    if json_depth(body) > max_depth:
        raise RequestError(f"the request body nests arrays/objects deeper than {max_depth} levels")


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays/objects in ``body``: the running sum of its brackets
    (``[{`` +1, ``]}`` -1) outside strings, at its highest (0 for none).

    One linear pass of vector operations, whatever the bytes (an earlier regex cut strings
    out by backtracking, and an unclosed string of escaped quotes took quadratic time: 3 s
    for 32 KiB). A quote is a string's edge unless an odd run of backslashes precedes it;
    a bracket is inside a string when an odd number of edges precede it. This is exact on
    valid JSON (backslashes occur only in strings), and on any other body it is exact on
    the longest valid prefix, the only part a decoder recurses into before its error: the
    check never lets through what a decoder would nest deeper. 4 MiB takes tens of ms of
    numpy, which releases the GIL (``server.py`` runs large bodies on a thread).
    """
    depth = highest = 0
    parity = 0  # quotes (string edges) so far, mod 2: 1 inside a string
    odd_run = 0  # 1: the bytes so far end in an odd run of backslashes
    for start in range(0, len(body), _SCAN_CHUNK_BYTES):
        raw = np.frombuffer(body, dtype=np.uint8, count=min(_SCAN_CHUNK_BYTES, len(body) - start), offset=start)
        n = len(raw)
        quote = raw == ord('"')
        backslash = raw == ord("\\")
        if odd_run or backslash.any():
            # run[i]: the backslashes ending at i (mod 2 from the slice before); the quote at
            # i is escaped when run[i - 1] is odd
            pos = np.arange(1, n + 1, dtype=np.int32)
            last_plain = np.maximum.accumulate(np.where(backslash, 0, pos))  # 1 + last non-backslash, or 0
            run = pos - last_plain + np.where(last_plain == 0, odd_run, 0)
            quote[0] &= odd_run == 0
            quote[1:] &= run[:-1] % 2 == 0
            odd_run = int(run[-1]) % 2
        inside = (np.cumsum(quote, dtype=np.int32) + parity) % 2 == 1
        parity = (parity + int(np.count_nonzero(quote))) % 2
        step = _STEP[raw]
        step[inside] = 0
        running = np.cumsum(step, dtype=np.int64) + depth
        highest = max(highest, int(running.max()))
        depth = int(running[-1])
    return highest
