"""Request limits (frontend/limits.py and where they are applied): each breach is a 400
naming its field. Pure and fast; the HTTP side is in test_guards.py."""

from __future__ import annotations

import json

import pytest

from planaria.engine.messages import EngineCoreOutput
from planaria.engine.sampling_params import SamplingParams
from planaria.frontend.embeddings import EmbeddingRequest, _inputs
from planaria.frontend.errors import EngineRequestError, RequestError, TooManyRequestsError
from planaria.frontend.generation import engine_error
from planaria.frontend.limits import RequestLimits, check_json_depth
from planaria.frontend.params import sampling_params
from planaria.frontend.prompts import tokenize_chat, tokenize_completion
from planaria.frontend.protocol import decode_chat, decode_completion
from tests.frontend._fakes import VOCAB, FakeTokenizer

TOK = FakeTokenizer()
LIMITS = RequestLimits()


def _param_of(fn) -> str | None:
    with pytest.raises(RequestError) as ei:
        fn()
    assert ei.value.status == 400 and ei.value.message
    return ei.value.param


def completion_params(**body):
    body.setdefault("prompt", "hi")
    return sampling_params(decode_completion(json.dumps(body).encode()), vocab_size=VOCAB)


@pytest.mark.parametrize("field, value", [
    ("seed", 2**70), ("seed", -(2**63) - 1), ("n", 2**64), ("max_tokens", 2**63), ("top_k", 2**100),
    ("priority", -(2**70)), ("min_tokens", 2**65), ("logprobs", 2**64), ("best_of", 2**64)])
def test_integers_beyond_64_bits_are_400_naming_the_field(field, value):
    assert _param_of(lambda: completion_params(**{field: value})) == field


def test_stop_token_id_and_prompt_token_id_beyond_64_bits():
    assert _param_of(lambda: completion_params(stop_token_ids=[1, 2**70])).startswith("stop_token_ids")
    assert _param_of(lambda: tokenize_completion([1, 2**70], TOK, VOCAB)) == "prompt"
    assert _param_of(lambda: tokenize_completion([[5, -1]], TOK, None)) == "prompt"


def test_stop_count_length_and_stop_token_ids_size():
    assert _param_of(lambda: completion_params(stop=["x"] * (LIMITS.max_stop + 1))) == "stop"
    assert _param_of(lambda: completion_params(stop="y" * (LIMITS.max_stop_chars + 1))) == "stop"
    assert _param_of(lambda: completion_params(stop_token_ids=list(range(LIMITS.max_stop_token_ids + 1)))) \
        == "stop_token_ids"
    p = completion_params(stop=["x"] * LIMITS.max_stop, stop_token_ids=[3, 4, 3])
    assert p.stop_token_ids == frozenset({3, 4})


def test_stop_token_ids_are_a_set_in_the_engine_and_a_list_on_the_wire():
    import msgspec

    p = SamplingParams(stop_token_ids=[7, 9, 7])
    assert isinstance(p.stop_token_ids, frozenset) and 9 in p.stop_token_ids
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(p))
    assert sorted(wire["stop_token_ids"]) == [7, 9]  # an array, as older peers read it
    back = msgspec.msgpack.decode(msgspec.msgpack.encode({"stop_token_ids": [1, 2]}), type=SamplingParams)
    assert back.stop_token_ids == frozenset({1, 2})


def test_prompt_count_and_characters_before_tokenizing():
    assert _param_of(lambda: tokenize_completion(["a"] * 3, TOK, VOCAB, max_prompts=2)) == "prompt"
    assert len(tokenize_completion(["a"] * 2, TOK, VOCAB, max_prompts=2)) == 2

    class NoEncode(FakeTokenizer):
        def encode(self, text, add_special_tokens=True):
            raise AssertionError("the tokenizer ran on a text over the limit")

    max_chars = LIMITS.max_prompt_chars(64)
    with pytest.raises(RequestError) as ei:
        tokenize_completion("x" * (max_chars + 1), NoEncode(), VOCAB, max_chars=max_chars)
    assert ei.value.param == "prompt" and ei.value.code == "context_length_exceeded"
    req = decode_chat(json.dumps({"messages": [{"role": "user", "content": "x" * (max_chars + 1)}]}).encode())
    assert _param_of(lambda: tokenize_chat(req, NoEncode(), max_chars)) == "messages"


def test_embedding_inputs_are_counted():
    req = EmbeddingRequest(input=["a"] * 5)
    assert _param_of(lambda: _inputs(req, 4)) == "input"
    assert _inputs(req, 5) == ["a"] * 5


@pytest.mark.parametrize("kwargs, param", [
    ({"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"},
     "chat_template_kwargs.chat_template"),
    ({"tokenize": True}, "chat_template_kwargs.tokenize"),
    ({"enable_thinking": "yes"}, "chat_template_kwargs.enable_thinking")])
def test_chat_template_kwargs_outside_the_allow_list_are_400(kwargs, param):
    class NoRender(FakeTokenizer):
        def apply_chat_template(self, messages, **kw):
            raise AssertionError("rendered")

    req = decode_chat(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                  "chat_template_kwargs": kwargs}).encode())
    assert _param_of(lambda: tokenize_chat(req, NoRender())) == param


def test_allowed_chat_template_kwargs_reach_the_template():
    seen = {}

    class Spy(FakeTokenizer):
        def apply_chat_template(self, messages, **kw):
            seen.update(kw)
            return super().apply_chat_template(messages, **kw)

    req = decode_chat(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                  "chat_template_kwargs": {"enable_thinking": False,
                                                           "add_generation_prompt": False}}).encode())
    tokenize_chat(req, Spy())
    assert seen == {"tokenize": False, "add_generation_prompt": False, "continue_final_message": False,
                    "enable_thinking": False}


def test_json_depth_is_checked_before_decoding():
    check_json_depth(b'{"a": [[1, 2], [3]], "s": "[[[[[[[[[[[["}', 3)  # brackets in strings do not count
    check_json_depth(b'{"s": "\\"[[[[[[[[[[[["}', 1)
    with pytest.raises(RequestError, match="deeper than 3"):
        check_json_depth(b'{"a": [[[1]]]}', 3)
    deep = b'{"prompt": "x", "response_format": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(RequestError):
        check_json_depth(deep, LIMITS.max_json_depth)
    with pytest.raises(RequestError, match="too deeply"):  # the decoder's own backstop
        decode_completion(b'{"prompt": "x", "response_format": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}")


@pytest.mark.parametrize("code, num_tokens, kind", [
    ("invalid_request", 3, RequestError), ("overloaded", 0, TooManyRequestsError),
    ("internal", 0, EngineRequestError), (None, 0, RequestError), (None, 2, EngineRequestError)])
def test_engine_error_codes(code, num_tokens, kind):
    err = engine_error(EngineCoreOutput(request_id="r", finish_reason="error", error="why",
                                        error_code=code), num_tokens)
    assert type(err) is kind and "why" in err.message
