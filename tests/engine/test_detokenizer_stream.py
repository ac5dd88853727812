"""The DecodeStream path of the incremental detokenizer (a fast tokenizer): the same text as
the window path, and its hand-over to the window decoder keeps the work per token bounded
when tokens never complete a character. The tokenizer and corpus: test_detokenizer.py."""

from __future__ import annotations

import random

import pytest
from tokenizers.decoders import DecodeStream

import planaria.engine.detokenizer as detokenizer
from planaria.engine.detokenizer import IncrementalDetokenizer
from planaria.engine.sampling_params import SamplingParams
from tests.engine.test_detokenizer import _CORPUS, TEXTS, _byte_token_ids, _stream, tokenizer  # noqa: F401


class DecodeOnly:
    """The same Rust decode without the Rust tokenizer: the window decoder's path."""

    def __init__(self, tok) -> None:
        self.raw = tok.backend_tokenizer

    def decode(self, ids, skip_special_tokens=True, **kw) -> str:
        return self.raw.decode(ids, skip_special_tokens=skip_special_tokens)


class StreamLog:
    """Stands in for DecodeStream: records each stream's step results (None: nothing out);
    ``fail_at`` makes that step (counted over all streams) raise, as a DecodeStreamError."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.streams: list[list[str | None]] = []
        self.fail_at = fail_at
        self.num_steps = 0

    def __call__(self, ids=None, skip_special_tokens=False):
        real, log, outer = DecodeStream(ids=ids, skip_special_tokens=skip_special_tokens), [], self
        self.streams.append(log)

        class Stream:
            def step(self, raw, token):
                outer.num_steps += 1
                if outer.num_steps == outer.fail_at:
                    raise Exception("InvalidPrefix")
                out = real.step(raw, token)
                log.append(out)
                return out
        return Stream()

    def longest_silent_run(self) -> int:
        longest = run = 0
        for log in self.streams:
            for out in log:
                run = run + 1 if out is None else 0
                longest = max(longest, run)
            run = 0
        return longest


@pytest.fixture
def streams(monkeypatch) -> StreamLog:
    log = StreamLog()
    monkeypatch.setattr(detokenizer, "DecodeStream", log)
    return log


def _both(tok, prompt, ids, params, chunk=1):
    """(text, stop) by the stream path and by the window path."""
    out = []
    for t in (tok, DecodeOnly(tok)):
        det, deltas, stop = _stream(t, prompt, ids, params, chunk)
        assert "".join(deltas) == det.output_text
        out.append((det.output_text, stop))
    return out


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stream_and_window_paths_give_the_same_text(tokenizer, streams, chunk):
    prompt = tokenizer.encode("Prompt: 東京 🎉", add_special_tokens=False)
    for text in [*TEXTS, _CORPUS]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        (got, _), (want, _) = _both(tokenizer, prompt, ids, SamplingParams(), chunk)
        assert got == want == text
    assert streams.num_steps > 0  # the stream path ran


def test_stop_strings_on_the_stream_path(tokenizer, streams):
    ids = tokenizer.encode(_CORPUS, add_special_tokens=False)
    for stop, include in ((["首都", "zzz"], False), (["jugs."], True), (["🚀 and"], False)):
        (got, got_stop), (want, want_stop) = _both(tokenizer, [], ids, SamplingParams(
            stop=stop, include_stop_str_in_output=include))
        assert (got, got_stop) == (want, want_stop) and got_stop == stop[0]
    assert streams.num_steps > 0


@pytest.mark.parametrize("pattern", [[0xE4], [0xE4, 0xB8], [0xF0, 0x9F, 0x98]])
def test_tokens_that_never_complete_a_character_hand_over_to_the_window(tokenizer, streams, pattern):
    """DecodeStream keeps every pending token in its window (each step would decode all of
    them: quadratic); past a few pending tokens the window decoder takes over."""
    byte_ids = _byte_token_ids(tokenizer)
    ids = [byte_ids[b] for b in pattern] * (3000 // len(pattern)) + tokenizer.encode(" ok", add_special_tokens=False)
    det, deltas, _ = _stream(tokenizer, [], ids, SamplingParams())
    assert "".join(deltas) == det.output_text == tokenizer.backend_tokenizer.decode(ids)
    assert streams.longest_silent_run() <= detokenizer._MAX_PENDING_TOKENS + 1
    assert streams.num_steps <= detokenizer._MAX_PENDING_TOKENS + 1  # not stepped after the hand-over


def test_random_bytes_on_both_paths(tokenizer, streams):
    rng = random.Random(11)
    byte_ids = _byte_token_ids(tokenizer)
    pieces = ["a", "é", "東", "🚀", " ", "x", "首都"]
    for _ in range(30):
        data = b"".join(rng.choice([rng.choice(pieces).encode(), bytes([rng.choice([0xE4, 0xB8, 0xF0, 0x80, 0xC3])])])
                        for _ in range(150))
        ids = [byte_ids[b] for b in data]
        params = SamplingParams(stop=["首都"]) if rng.random() < 0.5 else SamplingParams()
        (got, got_stop), (want, want_stop) = _both(tokenizer, [], ids, params, chunk=rng.choice([1, 2, 5]))
        assert (got, got_stop) == (want, want_stop)
        if got_stop is None:
            assert got == tokenizer.backend_tokenizer.decode(ids)
    assert streams.longest_silent_run() <= detokenizer._MAX_PENDING_TOKENS + 1


def test_a_run_of_skipped_special_tokens(tokenizer, streams):
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ab, cd = (tokenizer.encode(t, add_special_tokens=False) for t in ("ab", "cd"))
    ids = ab + [eot] * 10 + cd
    assert _both(tokenizer, [], ids, SamplingParams()) == [("abcd", None)] * 2
    kept = _both(tokenizer, [], ids, SamplingParams(skip_special_tokens=False))
    assert kept == [("ab" + "<|endoftext|>" * 10 + "cd", None)] * 2


def test_a_prompt_ending_mid_character(tokenizer, streams):
    ids = tokenizer.encode("x🚀", add_special_tokens=False)
    raw = tokenizer.backend_tokenizer
    cut = next(i for i in range(1, len(ids)) if raw.decode(ids[:i]).endswith("\ufffd"))
    out = tokenizer.encode("hello 東京", add_special_tokens=False)
    (got, _), (want, _) = _both(tokenizer, ids[:cut], out, SamplingParams())
    assert got == want and got.endswith("hello 東京")


def test_a_stream_error_hands_over_without_losing_text(tokenizer, monkeypatch):
    ids = tokenizer.encode(_CORPUS, add_special_tokens=False)
    for fail_at in (1, 2, 17, len(ids) - 1):
        monkeypatch.setattr(detokenizer, "DecodeStream", StreamLog(fail_at=fail_at))
        det, deltas, _ = _stream(tokenizer, tokenizer.encode("Prompt:", add_special_tokens=False), ids,
                                 SamplingParams(), chunk=3)
        assert "".join(deltas) == det.output_text == _CORPUS


def test_flush_after_a_hand_over_keeps_the_incomplete_character(tokenizer, streams):
    byte_ids = _byte_token_ids(tokenizer)
    ids = tokenizer.encode("ok", add_special_tokens=False) + [byte_ids[0xF0]] * 7
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    det.update(ids)
    assert det.get_delta_text() + det.flush() == tokenizer.backend_tokenizer.decode(ids)
