"""Request parsing, validation and conversion to SamplingParams. Pure and fast."""

from __future__ import annotations

import json

import pytest

from planaria.frontend.errors import RequestError
from planaria.frontend.params import check_bad_words, fit_max_tokens, num_choices, sampling_params, structured_output
from planaria.frontend.prompts import chat_messages, tokenize_bad_words, tokenize_chat, tokenize_completion
from planaria.frontend.protocol import decode_chat, decode_completion
from planaria.frontend.tool_parsers import HermesToolParser
from planaria.frontend.tools import tool_plan
from tests.frontend._fakes import VOCAB, FakeTokenizer

TOK = FakeTokenizer()


def completion(**body):
    body.setdefault("model", "m")
    body.setdefault("prompt", "hi")
    req = decode_completion(json.dumps(body).encode())
    params = sampling_params(req, vocab_size=VOCAB)
    prompts = tokenize_completion(req.prompt, TOK, VOCAB)
    num_choices(req, len(prompts))
    return req, params, prompts, structured_output(req)


def chat(**body):
    body.setdefault("model", "m")
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    req = decode_chat(json.dumps(body).encode())
    tools = tool_plan(req, HermesToolParser())
    params = sampling_params(req, vocab_size=VOCAB)
    num_choices(req)
    prompt = tokenize_chat(req, TOK, tools=tools.template_tools)
    return req, params, prompt, structured_output(req)


def test_completion_defaults_follow_openai():
    req, p, prompts, so = completion()
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.top_p == 1.0 and p.n == 1
    assert p.stop == [] and p.logprobs is None and not p.ignore_eos and so is None
    assert [x.token_ids for x in prompts] == [[ord("h"), ord("i")]] and prompts[0].text == "hi"


def test_completion_every_field_converts():
    _, p, _, _ = completion(
        max_tokens=7, temperature=0.5, top_p=0.9, n=1, stream=True, stream_options={"include_usage": True},
        stop="##", presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={}, logprobs=3, seed=42,
        user="u", echo=False, best_of=1, ignore_eos=True, min_tokens=2, top_k=5, min_p=0.1,
        repetition_penalty=1.1, stop_token_ids=[3, 4], skip_special_tokens=False,
        include_stop_str_in_output=True, priority=3, unknown_future_field={"x": 1})
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.presence_penalty, p.frequency_penalty) == \
        (7, 0.5, 0.9, ["##"], 0.5, -0.5)
    assert (p.logprobs, p.seed, p.ignore_eos, p.min_tokens, p.top_k, p.min_p) == (3, 42, True, 2, 5, 0.1)
    assert (p.repetition_penalty, p.stop_token_ids, p.skip_special_tokens, p.include_stop_str_in_output) == \
        (1.1, frozenset({3, 4}), False, True)


def test_logit_bias_is_clamped_and_token_controls_convert():
    body = {"prompt": "x", "logit_bias": {"5": 150, "6": -300, "7": 0.5, "08": 1}, "allowed_token_ids": [1, 2],
            "bad_words": ["ab", " c"]}
    req = decode_completion(json.dumps(body).encode())
    bad = tokenize_bad_words(check_bad_words(req.bad_words), TOK)
    assert bad == [[97, 98], [99]]  # " c" is stripped; with its space it is two tokens, not kept
    p = sampling_params(req, vocab_size=VOCAB, bad_words_token_ids=bad)
    assert p.logit_bias == {5: 100.0, 6: -100.0, 7: 0.5, 8: 1.0}
    assert p.allowed_token_ids == [1, 2] and p.bad_words_token_ids == bad and p.has_logit_controls
    with pytest.raises(ValueError, match="tokenized by the caller"):
        sampling_params(req, vocab_size=VOCAB)
    _, plain, _, _ = completion(logit_bias={})
    assert plain.logit_bias is None and not plain.has_logit_controls


class _WordTokenizer:
    """Whole texts to fixed ids: " cat" is one token of its own, " dog" a space then "dog"."""

    TABLE = {"cat": [1], " cat": [2], "dog": [3], " dog": [4, 3], "hot dog": [5, 4, 3], " hot dog": [6, 4, 3]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.TABLE[text]


def test_bad_words_tokenize_as_vllm_does():
    """Each word at the start of a text, and after a space when that is another first token
    of the same length (vLLM's SamplingParams.update_from_tokenizer)."""
    assert tokenize_bad_words(["cat", "  dog", "hot dog"], _WordTokenizer()) == \
        [[1], [2], [3], [5, 4, 3], [6, 4, 3]]


def test_nulls_mean_defaults():
    _, p, _, _ = completion(temperature=None, top_p=None, max_tokens=None, stop=None, n=None, seed=None,
                            ignore_eos=None, min_tokens=None, priority=None)
    assert p.temperature == 1.0 and p.max_tokens == 16 and p.stop == [] and p.min_tokens == 0


@pytest.mark.parametrize("prompt,expected", [
    ("ab", [[97, 98]]),
    (["ab", "c"], [[97, 98], [99]]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5, 6], [7]], [[5, 6], [7]]),
])
def test_completion_prompt_forms(prompt, expected):
    _, _, prompts, _ = completion(prompt=prompt)
    assert [x.token_ids for x in prompts] == expected


def test_chat_conversion_and_template():
    req, p, prompt, _ = chat(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "x", "function": {"name": "f"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "x"},
        {"role": "developer", "content": "d"},
    ], max_completion_tokens=9, max_tokens=3, logprobs=True, top_logprobs=2, stop=["x", "y"])
    assert p.max_tokens == 9 and p.logprobs == 2 and p.stop == ["x", "y"]
    # a template without tools (this one) gets calls and results written Hermes-style (tool_prompts.py)
    assert prompt.text == ("<system>be brief\n<user>a\nb\n<assistant><tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n"
                           "</tool_call>\n<user><tool_response>\n42\n</tool_response>\n<developer>d\n<assistant>")
    assert chat_messages(req)[3] == {"role": "tool", "content": "42", "tool_call_id": "x"}


def test_chat_max_tokens_default_is_open_and_capped_by_context():
    _, p, prompt, _ = chat()
    assert p.max_tokens is None
    fitted = fit_max_tokens(p, len(prompt.token_ids), 100)
    assert fitted.max_tokens == 100 - len(prompt.token_ids)


def test_chat_logprobs_false_means_none_and_true_means_zero_top():
    assert chat(logprobs=False)[1].logprobs is None
    assert chat(logprobs=True)[1].logprobs == 0


def test_prompt_logprobs_from_the_field_and_from_echo_with_logprobs():
    assert completion()[1].prompt_logprobs is None
    assert completion(logprobs=2)[1].prompt_logprobs is None  # no echo: generated tokens only
    assert completion(echo=True)[1].prompt_logprobs is None  # echo without logprobs
    assert completion(echo=True, logprobs=3)[1].prompt_logprobs == 3
    assert completion(echo=True, logprobs=0)[1].prompt_logprobs == 0
    assert completion(echo=True, logprobs=2, prompt_logprobs=5)[1].prompt_logprobs == 5  # the larger
    assert completion(echo=True, logprobs=4, prompt_logprobs=1)[1].prompt_logprobs == 4
    assert completion(echo=True, logprobs=2, stream=True)[1].prompt_logprobs == 2  # streamed echo: allowed
    assert completion(prompt_logprobs=0, stream=True)[1].prompt_logprobs is None  # as vLLM: 0 passes, shows nothing
    assert chat(prompt_logprobs=2)[1].prompt_logprobs == 2
    assert chat(echo=True, logprobs=True, top_logprobs=2)[1].prompt_logprobs is None  # echo is a completions thing


def test_n_and_best_of():
    req = completion(n=4)[0]
    assert num_choices(req, 1) == (4, 4)
    assert num_choices(completion(n=2, best_of=5)[0], 3) == (2, 5)
    assert num_choices(completion(best_of=3)[0]) == (1, 3)
    assert num_choices(chat(n=3)[0]) == (3, 3)
    assert completion(n=4)[1].n == 1  # one engine request per choice


def test_fit_max_tokens_caps_and_rejects():
    _, p, _, _ = completion(max_tokens=50, min_tokens=40)
    fitted = fit_max_tokens(p, 20, 32)
    assert fitted.max_tokens == 12 and fitted.min_tokens == 12
    assert fit_max_tokens(p, 2, 100).max_tokens == 50
    for n in (32, 40):
        with pytest.raises(RequestError) as ei:
            fit_max_tokens(p, n, 32)
        assert "maximum context length is 32" in ei.value.message and ei.value.code == "context_length_exceeded"
    with pytest.raises(RequestError, match="empty"):
        fit_max_tokens(p, 0, 32)


def test_structured_output_pass_through():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    so = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})[3]
    assert so == {"type": "json_schema", "value": json.dumps(schema)}
    assert chat(response_format={"type": "json_object"})[3]["type"] == "json_object"
    assert chat(response_format={"type": "text"})[3] is None
    assert completion(guided_json=schema)[3] == {"type": "json_schema", "value": json.dumps(schema)}
    assert completion(guided_regex="a+")[3] == {"type": "regex", "value": "a+"}
    assert completion(guided_choice=["y", "n"])[3] == {"type": "choice", "value": ["y", "n"]}
    assert completion(guided_grammar="root ::= 'a'")[3] == {"type": "grammar", "value": "root ::= 'a'"}


COMPLETION_BAD = [
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [[]]}, "prompt", "empty"),
    ({"prompt": [1, "a"]}, "prompt", "list of"),
    ({"prompt": [1, 999]}, "prompt", "outside the vocabulary"),
    ({"prompt": 5}, "prompt", "Expected"),
    ({"prompt": None}, "prompt", "Expected"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_tokens": -3}, "max_tokens", "at least 1"),
    ({"max_tokens": "10"}, "max_tokens", "Expected `int"),
    ({"max_tokens": 1.5}, "max_tokens", "Expected `int"),
    ({"temperature": -1}, "temperature", ">= 0"),
    ({"temperature": "hot"}, "temperature", "Expected"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"n": 0}, "n", "n must be an integer in [1, 16]"),
    ({"n": 17}, "n", "n must be an integer in [1, 16]"),
    ({"n": 3, "best_of": 2}, "best_of", "[n, 16]"),
    ({"best_of": 17}, "best_of", "[n, 16]"),
    ({"n": 2, "best_of": 3, "stream": True}, "best_of", "not supported with stream"),
    ({"prompt": ["a"] * 9, "n": 16}, "n", "more than the 128 sequences"),
    ({"stop": [1]}, "stop[0]", "Expected `str"),
    ({"stop": ""}, "stop", "non-empty"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
    ({"logit_bias": {"abc": 10}}, "logit_bias", "decimal integers"),
    ({"logit_bias": {"-1": 10}}, "logit_bias", "decimal integers"),
    ({"logit_bias": {"1" * 30: 10}}, "logit_bias", "decimal integers"),
    ({"logit_bias": {"999": 10}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ({"allowed_token_ids": [999]}, "allowed_token_ids", "outside the vocabulary"),
    ({"allowed_token_ids": [1] * 257}, "allowed_token_ids", "at most 256"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids[0]", "Expected"),
    ({"bad_words": [" "]}, "bad_words", "blank"),
    ({"bad_words": ["x"] * 65}, "bad_words", "at most 64"),
    ({"bad_words": ["x" * 257]}, "bad_words", "at most 256"),
    ({"bad_words": "word"}, "bad_words", "Expected `array"),
    ({"logprobs": 21}, "logprobs", "logprobs"),
    ({"logprobs": True}, "logprobs", "Expected `int"),
    ({"seed": "x"}, "seed", "Expected"),
    ({"suffix": "tail"}, "suffix", "not supported"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream is true"),
    ({"echo": True, "logprobs": 21}, "logprobs", "[0, 20]"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    ({"top_k": -2}, "top_k", "top_k"),
    ({"min_p": 2}, "min_p", "[0, 1]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens", "must not exceed"),
    ({"min_tokens": -1}, "min_tokens", "non-negative"),
    ({"stop_token_ids": [999]}, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids[0]", "Expected"),
    ({"ignore_eos": "yes"}, "ignore_eos", "Expected"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "response_format", "at most one"),
    ({"guided_choice": []}, "guided_choice", "empty"),
]


@pytest.mark.parametrize("body,param,reason", COMPLETION_BAD, ids=[json.dumps(b) for b, _, _ in COMPLETION_BAD])
def test_completion_bad_fields(body, param, reason):
    with pytest.raises(RequestError) as ei:
        completion(**body)
    err = ei.value
    assert err.status == 400 and err.param == param and reason in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


CHAT_BAD = [
    ({"messages": []}, "messages", "empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "role must be one of"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "missing required field `role`"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "only text parts"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "Expected"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name", "letters"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"top_logprobs": 3}, "top_logprobs", "logprobs set to true"),
    ({"n": 17}, "n", "[1, 16]"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"logprobs": 3}, "logprobs", "Expected `bool"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
    ({"logit_bias": {"1.5": -100}}, "logit_bias", "decimal integers"),
    ({"modalities": ["text", "audio"]}, "modalities", "text modality"),
    ({"continue_final_message": True}, "continue_final_message", "assistant"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream is true"),
    ({"prompt_logprobs": True}, "prompt_logprobs", "Expected `int"),
]


@pytest.mark.parametrize("body,param,reason", CHAT_BAD, ids=[json.dumps(b) for b, _, _ in CHAT_BAD])
def test_chat_bad_fields(body, param, reason):
    with pytest.raises(RequestError) as ei:
        chat(**body)
    assert ei.value.param == param and reason in ei.value.message


@pytest.mark.parametrize("raw,reason", [
    (b"", "empty"), (b"   ", "empty"), (b"{", "not valid JSON"), (b"[1, 2]", "Expected `object`"),
    (b'"prompt"', "Expected `object`"), (b"{}", "missing required field `prompt`"),
])
def test_bodies_that_are_not_requests(raw, reason):
    with pytest.raises(RequestError) as ei:
        decode_completion(raw)
    assert reason in ei.value.message


def test_missing_messages_names_the_field():
    with pytest.raises(RequestError) as ei:
        decode_chat(b'{"model": "m"}')
    assert ei.value.param == "messages"
