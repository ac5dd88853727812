"""Bad input fails only that request, with a clear reason; the rest complete."""

import pytest

from planaria.engine import LLM, SamplingParams
from planaria.engine.errors import InvalidRequestError
from planaria.engine.messages import EngineCoreRequest


@pytest.fixture(scope="module")
def llm(tiny_moe):
    return LLM(tiny_moe, kv_cache_bytes=16 * 2**20, max_model_len=512)


GOOD = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.mark.parametrize("params, reason", [
    (SamplingParams(max_tokens=0), "max_tokens must be at least 1"),
    (SamplingParams(max_tokens=-3), "max_tokens must be at least 1"),
    (SamplingParams(temperature=-0.5), "temperature must be >= 0"),
    (SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
    (SamplingParams(top_p=1.5), "top_p must be in (0, 1]"),
    (SamplingParams(stop_token_ids=[999999]), "outside the vocabulary"),
    (SamplingParams(max_tokens="7"), "max_tokens must be an integer"),
    (SamplingParams(temperature="hot"), "temperature must be a number"),
    (SamplingParams(top_k=-5), "top_k"),
    (SamplingParams(logprobs=10_000), "logprobs"),
])
def test_bad_params_fail_only_that_request(llm, params, reason):
    outs = llm.generate(["hello world", "def f(x):", "import os"], [GOOD, params, GOOD])
    assert outs[1].finish_reason == "error" and reason in outs[1].error
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 4
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 4


@pytest.mark.parametrize("prompt, reason", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([1] * 600, "maximum context length is 512"),
    ([5, -1], "outside the vocabulary"),
    ([5, 10**9], "outside the vocabulary"),
    (["a", "b"], "list of integers"),
    (3.5, "a prompt must be a string or a list of token ids"),
])
def test_bad_prompts_fail_only_that_request(llm, prompt, reason):
    outs = llm.generate(["ok then", prompt], [GOOD, GOOD]) if not isinstance(prompt, float) else \
        llm.generate(["ok then", prompt], [GOOD, GOOD])
    assert outs[1].finish_reason == "error" and reason in outs[1].error, outs[1].error
    assert outs[0].finish_reason == "length"


def test_core_rejects_duplicate_ids_and_keeps_serving(llm):
    core = llm.core
    req = EngineCoreRequest(request_id="dup", prompt_token_ids=[5, 6, 7], sampling_params=GOOD)
    core.add_request(req)
    core.add_request(EngineCoreRequest(request_id="dup", prompt_token_ids=[5], sampling_params=GOOD))
    finished = {}
    while core.has_unfinished_requests():
        outs, _ = core.step()
        for o in outs:
            if o.finished:
                finished.setdefault(o.request_id, []).append(o)
    assert [o.finish_reason for o in finished["dup"]] == ["error", "length"]
    assert "already in use" in finished["dup"][0].error


def test_sampling_params_validate_raises_typed_error():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2).validate()


@pytest.mark.parametrize("params, got", [({"max_tokens": 3}, "dict"), (5, "int"), ("greedy", "str")])
def test_non_sampling_params_is_a_clear_error(llm, params, got):
    outs = llm.generate(["hello world", "import os"], params)  # one bad value for every prompt
    for o in outs:
        assert o.finish_reason == "error" and o.token_ids == []
        assert o.error == f"sampling_params must be SamplingParams, got {got}"
    outs = llm.generate(["hello world", "import os"], [GOOD, params])  # only that request fails
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 4
    assert outs[1].finish_reason == "error" and "must be SamplingParams" in outs[1].error
    assert not llm.core.has_unfinished_requests()


def _finished(core) -> dict:
    finished = {}
    while core.has_unfinished_requests():
        for o in core.step()[0]:
            if o.finished:
                finished[o.request_id] = o
    return finished


def test_any_exception_while_admitting_fails_only_that_request_with_a_code(llm):
    """EngineCore.add_request never raises: the request at fault gets invalid_request, an
    unexpected exception internal (with its type in the text), the others run."""
    from planaria.engine.messages import OutputErrorCode

    core = llm.core
    deep = EngineCoreRequest(request_id="deep", prompt_token_ids=[5, 6], sampling_params=GOOD,
                             structured_output={"type": "json_schema", "value": "[" * 200_000})
    core.add_request(deep)  # json.loads raises RecursionError inside add_request
    broken = EngineCoreRequest(request_id="broken", prompt_token_ids=[5, 6], sampling_params=GOOD)
    broken.sampling_params = None  # not a SamplingParams: AttributeError, a non-request error type
    core.add_request(broken)
    core.add_request(EngineCoreRequest(request_id="fine", prompt_token_ids=[5, 6, 7], sampling_params=GOOD))
    core.add_request(EngineCoreRequest(request_id="", prompt_token_ids=[5], sampling_params=GOOD))
    got = _finished(core)
    assert got["deep"].finish_reason == "error" and "nested too deeply" in got["deep"].error
    assert got["deep"].error_code == OutputErrorCode.INVALID_REQUEST.value
    assert got["broken"].error_code == OutputErrorCode.INTERNAL.value
    assert got["broken"].error.startswith("internal error preparing the request: AttributeError")
    assert got[""].error_code == OutputErrorCode.INVALID_REQUEST.value
    assert got["fine"].finish_reason == "length" and got["fine"].error_code is None
