"""Incremental detokenizer: streaming deltas, stop strings, held-back tails."""

from __future__ import annotations

import pytest

from planaria.engine.detokenizer import IncrementalDetokenizer, detokenize_all
from planaria.engine.sampling_params import SamplingParams

_CORPUS = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Café, naïve, façade, résumé, jalapeño, Ångström, Zürich, São Paulo, Kraków.
東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.
Emoji: 😀 😃 🎉 👍🏽 🇯🇵 👨‍👩‍👧 ❤️ 🚀 and math: ∑ ∫ √ ≠ ≤ ≥ π ∞.
def main():\n    print("hello, world")\n    return 0\n
"""


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


def _stream(tok, prompt_ids, ids, params, chunk=1):
    det = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas, stop = [], None
    for i in range(0, len(ids), chunk):
        stop = det.update(ids[i:i + chunk])
        deltas.append(det.get_delta_text())
        if stop is not None:
            break
    if stop is None:
        deltas.append(det.flush())
    return det, deltas, stop


TEXTS = [
    "Hello world, this is plain ASCII.",
    "Café naïve façade — résumé jalapeño",
    "東京は日本の首都です。北京是中国的首都。",
    "😀🎉👍🏽🇯🇵👨‍👩‍👧❤️🚀 mixed 😃 emoji",
    "∑ ∫ √ ≠ π ∞ 서울은 한국의 수도 🚀🚀🚀",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streaming_deltas_concatenate_to_decode(tokenizer, text, chunk):
    prompt = tokenizer.encode("Prompt: 東京 🎉", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 5
    det, deltas, stop = _stream(tokenizer, prompt, ids, SamplingParams(), chunk)
    assert stop is None
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert det.output_text == text
    assert all("\ufffd" not in d for d in deltas)  # split characters are never emitted
    assert detokenize_all(tokenizer, ids) == text


def test_byte_tokens_of_one_character_are_held_until_complete(tokenizer):
    # '👨‍👩‍👧' is rare in training: it spans several byte-level tokens
    ids = tokenizer.encode("x👨‍👩‍👧", add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    seen = []
    for t in ids:
        det.update([t])
        seen.append(det.get_delta_text())
    assert "".join(seen) == "x👨‍👩‍👧"
    assert any(d == "" for d in seen[1:])  # some token completed no character


def test_special_tokens_skipped_or_kept(tokenizer):
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = tokenizer.encode("ab", add_special_tokens=False) + [eot] + tokenizer.encode("cd", add_special_tokens=False)
    _, deltas, _ = _stream(tokenizer, [], ids, SamplingParams())
    assert "".join(deltas) == "abcd"
    _, deltas, _ = _stream(tokenizer, [], ids, SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == "ab<|endoftext|>cd"
    assert detokenize_all(tokenizer, ids, skip_special_tokens=False) == "ab<|endoftext|>cd"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tokenizer, include):
    text = "The quick brown fox jumps over the lazy dog."
    ids = [t for ch in text for t in tokenizer.encode(ch, add_special_tokens=False)]  # one char a token
    params = SamplingParams(stop=["fox jum"], include_stop_str_in_output=include)
    det, deltas, stop = _stream(tokenizer, [], ids, params)
    assert stop == "fox jum"
    want = "The quick brown fox jum" if include else "The quick brown "
    assert det.output_text == want
    assert "".join(deltas) == want  # nothing after the stop is emitted
    assert det.update(tokenizer.encode(" more", add_special_tokens=False)) is None
    assert det.output_text == want and det.get_delta_text() == ""


def test_stop_string_inside_multichar_tokens(tokenizer):
    ids = tokenizer.encode("Pack my box with five dozen liquor jugs.", add_special_tokens=False)
    det, deltas, stop = _stream(tokenizer, [], ids, SamplingParams(stop=["ive doz", "zzz"]))
    assert stop == "ive doz"
    assert det.output_text == "Pack my box with f" == "".join(deltas)


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["four", "two"]))
    assert det.update(ids) == "two"
    assert det.output_text == "one "


def test_held_back_tail_is_released(tokenizer):
    ids = [t for ch in "say worl" for t in tokenizer.encode(ch, add_special_tokens=False)]
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["world"]))
    got = ""
    for t in ids:
        assert det.update([t]) is None
        got += det.get_delta_text()
    assert got == "say "  # "worl" may still become "world"
    assert det.flush() == "worl"
    assert det.output_text == "say worl"
    assert det.flush() == ""


def test_false_stop_prefix_is_released_when_it_diverges(tokenizer):
    ids = [t for ch in "a wor wow" for t in tokenizer.encode(ch, add_special_tokens=False)]
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["world"]))
    got = ""
    for t in ids:
        det.update([t])
        got += det.get_delta_text()
    assert got == "a wor wo"  # "wor" was released once "wor " diverged; the last "w" is held
    assert got + det.flush() == "a wor wow"


def test_stop_string_with_unicode(tokenizer):
    ids = tokenizer.encode("東京は日本の首都です。北京", add_special_tokens=False)
    det, deltas, stop = _stream(tokenizer, [], ids, SamplingParams(stop=["首都"]))
    assert stop == "首都"
    assert "".join(deltas) == det.output_text == "東京は日本の"


def test_window_stays_small(tokenizer):
    """Each update decodes a bounded window, not the whole output."""
    calls: list[int] = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def decode(self, ids, **kw):
            calls.append(len(ids))
            return self.inner.decode(ids, **kw)

    ids = tokenizer.encode(_CORPUS * 3, add_special_tokens=False)
    det = IncrementalDetokenizer(Counting(tokenizer), [], SamplingParams())
    for t in ids:
        det.update([t])
    det.flush()
    assert det.output_text == tokenizer.decode(ids)
    assert len(ids) > 300 and max(calls) <= 16  # the longest run of split characters


def test_flush_releases_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("ok🚀", add_special_tokens=False)
    raw = tokenizer.backend_tokenizer
    # find a prefix of the ids that ends mid-character
    cut = next(i for i in range(1, len(ids)) if raw.decode(ids[:i]).endswith("\ufffd"))
    det = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    det.update(ids[:cut])
    assert det.get_delta_text() == "ok"
    assert det.flush().endswith("\ufffd")
    assert det.output_text == raw.decode(ids[:cut])


def _byte_token_ids(tokenizer) -> dict[int, int]:
    """byte -> the id of the byte-level token that is that byte alone."""
    # GPT-2's byte -> printable character map, the one pre_tokenizers.ByteLevel uses
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {b: tokenizer.convert_tokens_to_ids(ch) for b, ch in chars.items()}


class _Counting:
    def __init__(self, inner, calls):
        self.inner, self.calls = inner, calls

    def decode(self, ids, **kw):
        self.calls.append(len(ids))
        return self.inner.decode(ids, **kw)


@pytest.mark.parametrize("pattern", [[0xE4], [0xE4, 0xB8], [0xF0, 0x9F, 0x98]])
def test_tokens_that_never_complete_a_character_cost_a_bounded_window(tokenizer, pattern):
    """allowed_token_ids of one lone lead byte, ignore_eos: every token ends mid-character
    for ever. Each update used to decode everything since the last whole character
    (quadratic on the event loop: ~100 s for one n=16 request); now a bounded window, and
    the text is still the whole decode's."""
    byte_ids = _byte_token_ids(tokenizer)
    ids = [byte_ids[b] for b in pattern] * (3000 // len(pattern)) + tokenizer.encode(" ok", add_special_tokens=False)
    calls: list[int] = []
    det, deltas, _ = _stream(_Counting(tokenizer, calls), [], ids, SamplingParams())
    assert "".join(deltas) == det.output_text == tokenizer.backend_tokenizer.decode(ids)
    assert max(calls) <= 48, max(calls)


def test_random_bytes_stream_to_the_whole_decode(tokenizer):
    """Byte tokens of valid and invalid UTF-8 mixed at random: the streamed text equals the
    whole decode (the window's cut behind the last token never moves a character)."""
    import random

    rng = random.Random(7)
    byte_ids = _byte_token_ids(tokenizer)
    pieces = ["a", "é", "東", "🚀", " ", "x"]
    for _ in range(30):
        data = b"".join(rng.choice([rng.choice(pieces).encode(), bytes([rng.choice([0xE4, 0xB8, 0xF0, 0x80, 0xC3])])])
                        for _ in range(200))
        ids = [byte_ids[b] for b in data]
        det, deltas, _ = _stream(tokenizer, [], ids, SamplingParams(), chunk=rng.choice([1, 2, 5]))
        assert "".join(deltas) == tokenizer.backend_tokenizer.decode(ids)
