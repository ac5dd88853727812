"""Incremental detokenization with stop strings.

Text comes from one of two decoders behind ``_TextDecoder``:

``_StreamDecoder``, for a fast tokenizer (a Rust ``tokenizers.Tokenizer`` behind it), is
``tokenizers.decoders.DecodeStream``, as vLLM v1 uses it: each token's step decodes, in
Rust, the tokens of the last chunks plus the new one and returns the new text, or None
while the text ends in U+FFFD (an incomplete UTF-8 sequence from byte-level BPE) or did not
grow (a skipped special token). DecodeStream keeps every pending token in its window, so
tokens that never complete a character (a lone lead byte, again and again:
``allowed_token_ids`` can force it) would make each step decode everything since the last
whole character, quadratic work on the frontend's event loop. Past ``_MAX_PENDING_TOKENS``
pending tokens (or a stream error) the decoder hands the request over to a window decoder,
seeded with the last chunk's tokens as left context, for good.

``_WindowDecoder``, for any tokenizer with ``decode`` (and after a hand-over), decodes a
small window of recent tokens, not the whole output (the prefix-offset/read-offset technique
of vLLM and HF TGI): ``prefix_offset..read_offset`` is text already produced, kept as left
context so that the tokenizer's merging and spacing rules see what precedes the new tokens;
``decode(window) - decode(prefix)`` is the new text. While the window's text ends in U+FFFD
the characters before it are released but the offsets stay put, so the next token re-decodes
the split character whole. The window never grows without bound: past a few pending tokens
the offsets move behind the last token (``_commit_behind_last_token``), so every token costs
a bounded decode.

Stop strings are searched only where a new character could complete one. ``get_delta_text``
holds back the tail that may still turn into a stop string (unless the stop string is to be
included anyway); ``flush`` releases it, and any undecodable bytes, when the request ends.
"""

from __future__ import annotations

from typing import Callable, Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from planaria.engine.sampling_params import SamplingParams

# Tokens of prompt kept as left context for the first output tokens (as vLLM).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
# Pending tokens (after the last whole character) before the window is cut behind its last
# token: a UTF-8 character has at most 4 bytes, so more than 4 tokens that end mid-character
# are invalid bytes or a run of tokens split across characters.
_MAX_PENDING_TOKENS = 4
_MAX_WINDOW_TOKENS = 32


def _raw_tokenizer(tokenizer) -> Tokenizer | None:
    """The Rust tokenizer behind a fast HF tokenizer (or the tokenizer itself), else None."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    raw = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    return raw if isinstance(raw, Tokenizer) else None


def _decode_fn(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """The cheapest decode the tokenizer offers: the Rust tokenizer behind a fast HF one."""
    raw = _raw_tokenizer(tokenizer)
    if raw is not None:
        return lambda ids: raw.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


def detokenize_all(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The whole text at once, decoded as IncrementalDetokenizer decodes its windows."""
    return _decode_fn(tokenizer, skip_special_tokens)(list(ids))


class _TextDecoder(Protocol):
    def push(self, ids: list[int]) -> str:
        """Text the new tokens complete (possibly none)."""

    def flush(self) -> str:
        """Text of the tokens still pending, an incomplete character as U+FFFD."""


class _WindowDecoder:
    """The prefix/read-offset window over any ``decode`` (module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], context: list[int]) -> None:
        self._decode = decode
        self._ids: list[int] = list(context)  # left context, then every new token
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = decode(self._ids) if self._ids else ""
        self._num_window_chars = 0  # chars past prefix_text already taken from this window

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        return self._decode_window(force=False)

    def flush(self) -> str:
        return self._decode_window(force=True)

    def _decode_window(self, force: bool) -> str:
        """New text from the window ``prefix_offset..``. Characters before a trailing
        incomplete one are released at once; the offsets move when the window ends on a
        whole character, or, once more than ``_MAX_PENDING_TOKENS`` tokens wait, at the
        last token boundary that the text no longer changes behind (bounded: below)."""
        if len(self._ids) == self._read_offset:
            return ""
        text = self._decode(self._ids[self._prefix_offset:])
        clean = force or not text.endswith(_REPLACEMENT)
        end = len(text) if clean else len(text.rstrip(_REPLACEMENT))
        start = len(self._prefix_text) + self._num_window_chars
        delta = text[start:end] if end > start else ""
        self._num_window_chars += len(delta)
        if clean:
            self._commit(len(self._ids))
        elif len(self._ids) - self._read_offset > _MAX_PENDING_TOKENS:
            delta += self._commit_behind_last_token(text)
        return delta

    def _commit(self, boundary: int) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, boundary
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        self._num_window_chars = 0

    def _commit_behind_last_token(self, text: str) -> str:
        """A window that keeps ending in U+FFFD. A trailing incomplete character spans at
        most 3 bytes, so with more tokens pending, some of the U+FFFD before it are invalid
        bytes that no later token can change (a lone lead byte, again and again). A token
        boundary ``b`` among the last three is a character boundary when the window's text
        is the text before ``b`` followed by the text from ``b`` (a boundary inside a
        character decodes both halves to U+FFFD, so the sum differs): there the text is
        final, the offsets move, and the window stops growing. A run of tokens that never
        ends on a character boundary (possible only by choice of token ids, or a decoder
        whose pieces do not add up) is cut at the last token after ``_MAX_WINDOW_TOKENS``
        (a character split there comes out as U+FFFD). Either way each token costs a
        bounded window, never a decode of everything since the last whole character.
        Returns the text this releases."""
        for back in (1, 2, 3):
            boundary = len(self._ids) - back
            if boundary <= self._read_offset:
                break
            head = self._decode(self._ids[self._prefix_offset:boundary])
            if head + self._decode(self._ids[boundary:]) == text:
                break
        else:
            boundary = -1
        if boundary <= self._read_offset:
            if len(self._ids) - self._read_offset <= _MAX_WINDOW_TOKENS:
                return ""
            boundary = len(self._ids) - 1
            head = self._decode(self._ids[self._prefix_offset:boundary])
        released = len(self._prefix_text) + self._num_window_chars
        extra = head[released:]
        self._commit(boundary)
        # characters past `head` already released (before the trailing U+FFFD) belong to
        # the new window's pending part
        self._num_window_chars = max(0, released - len(head))
        return extra



class _StreamDecoder:
    """``DecodeStream`` while it keeps up; past ``_MAX_PENDING_TOKENS`` pending tokens, or
    a stream error, a ``_WindowDecoder`` from then on (module docstring)."""

    def __init__(self, raw: Tokenizer, decode: Callable[[list[int]], str], context: list[int],
                 skip_special_tokens: bool) -> None:
        self._raw, self._decode = raw, decode
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._context = list(context)  # the tokens of the last chunk: left context for a hand-over
        self._pending: list[int] = []  # tokens since the last chunk
        self._window: _WindowDecoder | None = None

    def push(self, ids: list[int]) -> str:
        if self._window is not None:
            return self._window.push(ids)
        chunks = []
        for i, token in enumerate(ids):  # one step a token: each whole character goes out at once
            try:
                chunk = self._stream.step(self._raw, token)
            except Exception:  # DecodeStreamError (raised as a plain Exception): the text
                # changed behind the stream's prefix, which a decoder's rules may do
                return "".join(chunks) + self._hand_over(ids[i:])
            if chunk is None:
                self._pending.append(token)
                if len(self._pending) > _MAX_PENDING_TOKENS:
                    return "".join(chunks) + self._hand_over(ids[i + 1:])
            else:
                self._pending.append(token)
                self._context, self._pending = self._pending, []
                chunks.append(chunk)
        return "".join(chunks)

    def flush(self) -> str:
        if self._window is None:
            self._hand_over([])
        return self._window.flush()

    def _hand_over(self, ids: list[int]) -> str:
        """The window decoder takes over: the last chunk's tokens as its left context, the
        pending tokens and ``ids`` as its new ones."""
        self._window = _WindowDecoder(self._decode, self._context)
        return self._window.push(self._pending + ids)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        decode = _decode_fn(tokenizer, params.skip_special_tokens)
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        raw = _raw_tokenizer(tokenizer)
        self._decoder: _TextDecoder
        # DecodeStream re-emits a context that ends mid-character; the window decoder does not
        if raw is not None and not (context and decode(context).endswith(_REPLACEMENT)):
            self._decoder = _StreamDecoder(raw, decode, context, params.skip_special_tokens)
        else:
            self._decoder = _WindowDecoder(decode, context)
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._max_stop_chars = max((len(s) for s in self._stops), default=0)
        self._chunks: list[str] = []  # output text, in pieces (joined on demand)
        self._num_chars = 0
        self._num_returned_chars = 0
        self._finished = False
        self.stop_str: str | None = None

    # -- text ----------------------------------------------------------------------------
    @property
    def output_text(self) -> str:
        """All text so far; a matched stop string is excluded unless included by request."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string they completed, if any. Tokens after a
        stop (or after flush) are ignored."""
        if self.stop_str is not None or self._finished:
            return None
        return self._append(self._decoder.push(new_token_ids))

    def get_delta_text(self) -> str:
        """Text not yet returned, less a tail that may begin a stop string."""
        end = self._num_chars
        if not self._finished and self.stop_str is None and not self._include_stop:
            end -= self._held_back_chars()
        if end <= self._num_returned_chars:
            return ""
        # Only the last chunks can hold unreturned text; join the tail, not the whole.
        tail = self._tail(self._num_chars - self._num_returned_chars)
        delta = tail[:end - self._num_returned_chars]
        self._num_returned_chars = end
        return delta

    def flush(self) -> str:
        """The request ended without a stop: decode what is pending (U+FFFD and all) and
        return everything not yet returned."""
        if self.stop_str is None and not self._finished:
            self._append(self._decoder.flush())
        self._finished = True
        return self.get_delta_text()

    # -- stop strings and the output's pieces ---------------------------------------------
    def _append(self, delta: str) -> str | None:
        if not delta:
            return None
        old_len = self._num_chars
        self._chunks.append(delta)
        self._num_chars += len(delta)
        if not self._stops:
            return None
        # Search only where a stop string could end in the new characters.
        window_start = max(0, old_len - self._max_stop_chars + 1)
        window = self._tail(self._num_chars - window_start)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = window.find(stop, max(0, old_len - len(stop) + 1 - window_start))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        cut = window_start + at + (len(stop) if self._include_stop else 0)
        self._truncate(max(cut, self._num_returned_chars))
        self.stop_str = stop
        return stop

    def _tail(self, num_chars: int) -> str:
        """The last ``num_chars`` characters of the output, joining only the chunks needed
        (and merging them into one, so repeated calls stay cheap)."""
        if num_chars <= 0:
            return ""
        taken, i = 0, len(self._chunks)
        while i > 0 and taken < num_chars:
            i -= 1
            taken += len(self._chunks[i])
        if len(self._chunks) - i > 1:
            self._chunks[i:] = ["".join(self._chunks[i:])]
        return self._chunks[i][-num_chars:] if num_chars <= len(self._chunks[i]) else self._chunks[i]

    def _truncate(self, num_chars: int) -> None:
        drop = self._num_chars - num_chars
        if drop <= 0:
            return
        self._tail(drop)  # merges the chunks covering the last `drop` characters into one
        self._chunks[-1] = self._chunks[-1][:len(self._chunks[-1]) - drop]
        self._num_chars = num_chars

    def _held_back_chars(self) -> int:
        """Length of the longest output suffix that is a proper prefix of a stop string."""
        if not self._stops:
            return 0
        longest = min(self._max_stop_chars - 1, self._num_chars - self._num_returned_chars)
        if longest <= 0:
            return 0
        tail = self._tail(longest)
        for k in range(longest, 0, -1):
            suffix = tail[-k:]
            if any(s.startswith(suffix) for s in self._stops):
                return k
        return 0
