"""Structured outputs on a random-weight model: every output parses and obeys its spec."""

from __future__ import annotations

import json
import re
import time

import pytest

from planaria.engine.llm import LLM
from planaria.engine.messages import EngineCoreRequest
from planaria.engine.request import Request
from planaria.engine.sampling_params import SamplingParams
from planaria.engine.structured_output import grammar_source

pytest.importorskip("llguidance")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "color": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "color"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                                   "y": {"type": "number", "minimum": -10, "maximum": 10}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
     "required": ["point", "tags"], "additionalProperties": False},
    {"type": "string", "maxLength": 8},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                      "kind": {"const": "user"}},
     "required": ["id", "kind"], "additionalProperties": False},
]


def validate(value, schema: dict, path: str = "$") -> None:
    """A small JSON-schema validator for the keywords SCHEMAS use."""
    if "const" in schema:
        assert value == schema["const"], path
    if "enum" in schema:
        assert value in schema["enum"], path
    kind = schema.get("type")
    if kind == "object":
        assert isinstance(value, dict), path
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), path
        for key, sub in props.items():
            if key in value:
                validate(value[key], sub, f"{path}.{key}")
    elif kind == "array":
        assert isinstance(value, list), path
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9), path
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{path}[{i}]")
    elif kind == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 10**9), path
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), path
    elif kind == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), path
    elif kind == "boolean":
        assert isinstance(value, bool), path
    if kind in ("integer", "number"):
        assert schema.get("minimum", -float("inf")) <= value <= schema.get("maximum", float("inf")), path


@pytest.fixture(scope="module")
def llm(tiny_moe):
    return LLM(tiny_moe, num_kv_blocks=512)


def _sampled(seed: int, max_tokens: int = 160) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)


def test_json_schema_outputs_validate(llm):
    prompts, params, specs = [], [], []
    for i, schema in enumerate(SCHEMAS):
        for seed in range(3):
            prompts.append(f"Give me some JSON number {i}")
            params.append(_sampled(seed))
            specs.append({"type": "json_schema", "value": json.dumps(schema)})
    outs = llm.generate(prompts, params, structured_output=specs)
    for out, spec in zip(outs, specs):
        assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
        validate(json.loads(out.text), json.loads(spec["value"]))


def test_json_object_outputs_parse(llm):
    """Any JSON object: random weights may write a key for ever, so most, not all, end."""
    outs = llm.generate(["hello"] * 8, [_sampled(seed, 256) for seed in range(8)],
                        structured_output={"type": "json_object"})
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= 6, [(o.finish_reason, o.error) for o in outs]
    for o in stopped:
        assert isinstance(json.loads(o.text), dict)
    assert all(o.text.startswith("{") for o in outs)


def test_regex_choice_grammar(llm):
    specs = [{"type": "regex", "value": r"[a-z]{3}-[0-9]{2}"},
             {"type": "choice", "value": ["yes", "no", "maybe so"]},
             {"type": "grammar", "value": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/'}]
    for seed in range(4):
        outs = llm.generate(["hello"] * len(specs), [_sampled(seed, 256)] * len(specs), structured_output=specs)
        assert all(o.finish_reason == "stop" for o in outs), [(o.finish_reason, o.error) for o in outs]
        assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", outs[0].text)
        assert outs[1].text in ("yes", "no", "maybe so")
        assert re.fullmatch(r"\((\d{1,3})(\+\d{1,3})*\)", outs[2].text)


@pytest.mark.parametrize("bad", [
    {"type": "json_schema", "value": '{"type": "bogus"}'},
    {"type": "json_schema", "value": "{not json"},
    {"type": "regex", "value": "(("},
    {"type": "grammar", "value": "start: undefined_rule"},
    {"type": "choice", "value": []},
    {"type": "nonsense"},
])
def test_broken_spec_fails_only_that_request(llm, bad):
    good = {"type": "choice", "value": ["alpha", "beta"]}
    outs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=16, temperature=0),
                        structured_output=[good, bad, None])
    assert outs[1].finish_reason == "error" and outs[1].error
    assert outs[0].finish_reason == "stop" and outs[0].text in ("alpha", "beta")
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 16


def _run(core, reqs):
    tokens = {r.request_id: [] for r in reqs}
    finish = {}
    for r in reqs:
        core.add_request(r)
    while core.has_unfinished_requests():
        for o in core.step()[0]:
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                finish[o.request_id] = (o.finish_reason, o.error)
    return tokens, finish


def test_replay_prefix_continues_to_a_valid_document(llm):
    core, tok = llm.core, llm.tokenizer
    schema = SCHEMAS[3]
    spec = {"type": "json_schema", "value": json.dumps(schema)}
    prompt = tok.encode("replay me")
    for seed in range(3):
        first, fin = _run(core, [EngineCoreRequest(
            request_id=f"full-{seed}", prompt_token_ids=prompt, sampling_params=_sampled(seed),
            eos_token_id=llm.eos_token_id, structured_output=spec)])
        full = first[f"full-{seed}"]
        assert fin[f"full-{seed}"][0] == "stop"
        for k in (1, len(full) // 2, len(full) - 2):
            done = [t for t in full[:k] if t != llm.eos_token_id]
            rid = f"replay-{seed}-{k}"
            rest, fin = _run(core, [EngineCoreRequest(
                request_id=rid, prompt_token_ids=prompt + done, sampling_params=_sampled(seed + 100),
                eos_token_id=llm.eos_token_id, structured_output=spec,
                structured_output_prefix_tokens=done)])
            assert fin[rid][0] == "stop", fin[rid]
            validate(json.loads(tok.decode(done + rest[rid], skip_special_tokens=True)), schema)


def test_replay_prefix_that_breaks_the_grammar_fails(llm):
    core, tok = llm.core, llm.tokenizer
    bad_prefix = tok.encode("not json at all")
    _, fin = _run(core, [EngineCoreRequest(
        request_id="bad-prefix", prompt_token_ids=tok.encode("x") + bad_prefix,
        sampling_params=_sampled(0), eos_token_id=llm.eos_token_id,
        structured_output={"type": "json_object"}, structured_output_prefix_tokens=bad_prefix)])
    assert fin["bad-prefix"][0] == "error" and "prefix" in fin["bad-prefix"][1]
    _, fin = _run(core, [EngineCoreRequest(
        request_id="not-tail", prompt_token_ids=tok.encode("x"), sampling_params=_sampled(0),
        structured_output={"type": "json_object"}, structured_output_prefix_tokens=[5, 6])])
    assert fin["not-tail"][0] == "error"


def test_replay_prefix_that_completes_the_grammar_stops_at_once(llm):
    core, tok = llm.core, llm.tokenizer
    done = tok.encode("yes")
    tokens, fin = _run(core, [EngineCoreRequest(
        request_id="complete", prompt_token_ids=tok.encode("q") + done, sampling_params=_sampled(0),
        structured_output={"type": "choice", "value": ["yes", "no"]}, structured_output_prefix_tokens=done)])
    assert fin["complete"] == ("stop", None) and tokens["complete"] == []


def test_abort_while_compiling_is_clean(llm):
    core = llm.core
    core.add_request(EngineCoreRequest(request_id="gone", prompt_token_ids=[1, 2, 3],
                                       sampling_params=_sampled(0), structured_output={"type": "json_object"}))
    core.abort_requests(["gone"])
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()[0]
    deadline = time.monotonic() + 60
    while core.structured.num_pending:  # until the compile finished and a step took it up
        assert time.monotonic() < deadline, "the grammar never finished compiling"
        time.sleep(0.01)
        outputs += core.step()[0]
    assert not core.has_unfinished_requests()  # the finished compile of an aborted request is dropped
    assert [o.finish_reason for o in outputs if o.request_id == "gone"] == ["abort"]


def test_no_grammar_fast_path_costs_nothing(llm):
    """No grammar in the batch: no mask work, a few microseconds per 64 rows."""
    mgr = llm.core.structured
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(), None, 8) for i in range(64)]
    assert mgr.start_bitmask(reqs) is None
    t0 = time.perf_counter()
    for _ in range(1000):
        mgr.start_bitmask(reqs)
    per_step_s = (time.perf_counter() - t0) / 1000
    assert per_step_s < 50e-6, per_step_s


def test_grammar_source_rejects_malformed_specs():
    from planaria.engine.errors import InvalidRequestError

    for bad in ({"type": "regex"}, {"type": "choice", "value": [1]}, "json", {"type": "json_schema", "value": "[1]"}):
        with pytest.raises(InvalidRequestError):
            grammar_source(bad)


def test_a_grammar_no_token_can_continue_is_the_requests_error(llm):
    """A mask that allows nothing (the grammar needs bytes no token of this vocabulary
    produces) marks only that request; the token sampled from all -inf breaks the grammar,
    and the error says why, as the request's fault (400), not an internal one."""
    import torch

    mgr = llm.core.structured
    other = Request("other", [1, 2], SamplingParams(), None, 8)
    req = Request("dead", [1, 2], SamplingParams(), None, 8)
    mgr.submit(req, {"type": "choice", "value": ["ab"]})
    deadline = time.monotonic() + 30
    while not mgr.take_ready()[0]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    mask = mgr.start_bitmask([other, req])
    mask._future.result()
    allowed = [(int(mask.bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(mgr.vocab_size)]
    refused = allowed.index(0)
    mask.bitmask.zero_()  # nothing allowed
    logits = torch.zeros(2, mgr.vocab_size)
    mask.apply(logits, [other, req])  # row 0: no grammar; row 1: the request
    assert req.structured.dead_end and other.structured is None
    assert torch.isneginf(logits[1]).all() and torch.isfinite(logits[0]).all()
    verdict = mgr.accept(req, refused)
    assert verdict.startswith("structured output cannot continue: no token of this model's vocabulary"), verdict
