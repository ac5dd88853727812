"""Logit bias, allowed token ids and bad words in the sampler (engine/logit_controls.py via
engine/sampler.py): what each does to greedy and random rows, that a bias never revives a
grammar's -inf, the fast path for batches without controls, replayed output counted for
bad words, rows left with no token, validation and the wire."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from planaria.engine.errors import InvalidRequestError
from planaria.engine.messages import EngineCoreRequest
from planaria.engine.sampler import Sampler
from planaria.engine.sampling_metadata import PRIOR_OUTPUT_TOKENS_KEY, SamplingMetadata
from planaria.engine.sampling_params import SamplingParams
from tests.engine.test_sampler import EOS, V, _req, _sample


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, V, generator=g) * 3  # [N, V]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


def test_bias_minus_100_moves_greedy_off_its_token_plus_100_forces_one(logits):
    top2 = logits[0].topk(2).indices.tolist()
    low = int(logits[0].argmin())
    out = _sample(logits[:1], [_req(_greedy(logit_bias={top2[0]: -100.0}))])
    assert int(out.sampled_token_ids[0]) == top2[1]
    out = _sample(logits[:1], [_req(_greedy(logit_bias={low: 100.0}))])
    assert int(out.sampled_token_ids[0]) == low
    # a small bias adds exactly: logprobs see it (the distribution sampled at temperature 1)
    lp = _sample(logits[:1], [_req(_greedy(logit_bias={low: 2.5}, logprobs=V))]).logprobs[0]
    want = logits[0].clone()
    want[low] += 2.5
    got = dict(zip(lp.token_ids[1:], lp.logprobs[1:]))
    assert got[low] == pytest.approx(float(torch.log_softmax(want, -1)[low]), abs=1e-5)


def test_rows_without_controls_keep_the_fast_path_and_their_tokens(logits):
    plain = [_req(_greedy(), rid=str(i)) for i in range(8)]
    assert SamplingMetadata.build(plain, V, "cpu").plain_greedy
    low = int(logits[3].argmin())
    reqs = plain[:3] + [_req(_greedy(logit_bias={low: 100.0}), rid="b")] + plain[4:]
    md = SamplingMetadata.build(reqs, V, "cpu")
    assert not md.plain_greedy and md.controls is not None and md.penalties is None
    out = Sampler()(logits, md).sampled_token_ids
    want = logits.argmax(-1)
    want[3] = low
    assert torch.equal(out, want)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 5.0])
def test_bias_never_revives_a_grammar_masked_token(temperature):
    """The grammar leaves tokens 7 and 8 (-inf elsewhere, as GrammarBitmask.apply does)."""
    row = torch.full((1, V), float("-inf"))
    row[0, 7], row[0, 8] = 1.5, -0.5
    bias = {t: 100.0 for t in range(0, V, 3)} | {8: -100.0}
    for seed in range(20):
        torch.manual_seed(seed)
        params = SamplingParams(temperature=temperature, logit_bias=bias, logprobs=2)
        out = _sample(row.clone(), [_req(params)])
        assert int(out.sampled_token_ids[0]) == 7
        assert out.rows_without_token() == []


def test_allowed_token_ids_restrict_every_draw():
    allowed = [2, 9, 40, 63]
    row = torch.zeros(1, V)
    row[0, 5] = 8.0  # the model's favourite is not allowed
    params = SamplingParams(temperature=1.0, allowed_token_ids=allowed)
    torch.manual_seed(0)
    x = row.expand(2000, -1).contiguous()
    out = _sample(x, [_req(params, rid=str(i)) for i in range(2000)]).sampled_token_ids
    assert set(out.tolist()) == set(allowed)  # each allowed one drawn, nothing else
    assert int(_sample(row, [_req(_greedy(allowed_token_ids=allowed))]).sampled_token_ids[0]) in allowed


def test_bad_words_single_tokens_always_and_sequences_after_their_prefix():
    row = torch.zeros(1, V)
    row[0, 10], row[0, 11], row[0, 12] = 9.0, 8.0, 7.0
    words = [[10], [4, 5, 11]]
    params = _greedy(bad_words_token_ids=words)
    assert int(_sample(row, [_req(params)]).sampled_token_ids[0]) == 11  # 10 banned, 11 only after 4 5
    assert int(_sample(row, [_req(params, output=[4])]).sampled_token_ids[0]) == 11
    assert int(_sample(row, [_req(params, output=[1, 4, 5])]).sampled_token_ids[0]) == 12
    assert int(_sample(row, [_req(params, output=[4, 5, 1])]).sampled_token_ids[0]) == 11
    # a replay: 4 5 were generated before the engine died, now the prompt's tail
    replayed = _req(params, prompt=(1, 2, 4, 5))
    replayed.extra[PRIOR_OUTPUT_TOKENS_KEY] = 2
    assert int(_sample(row, [replayed]).sampled_token_ids[0]) == 12
    # half the prefix in the prompt (prior output), half generated since
    half = _req(params, prompt=(1, 2, 4), output=[5])
    half.extra[PRIOR_OUTPUT_TOKENS_KEY] = 1
    assert int(_sample(row, [half]).sampled_token_ids[0]) == 12
    # the prompt itself is not output: 4 5 there, not generated, bans nothing
    assert int(_sample(row, [_req(params, prompt=(4, 5))]).sampled_token_ids[0]) == 11


def test_rows_left_with_no_token_are_reported():
    row = torch.randn(3, V)
    reqs = [_req(_greedy(allowed_token_ids=[5], bad_words_token_ids=[[5]]), rid="a"),
            _req(_greedy(allowed_token_ids=[5, 6], bad_words_token_ids=[[5]]), rid="b"),
            _req(SamplingParams(temperature=0.7, allowed_token_ids=[EOS], min_tokens=2), rid="c")]
    out = _sample(row, reqs)
    assert out.rows_without_token() == [0, 2]
    assert int(out.sampled_token_ids[1]) == 6


def test_controls_are_cached_per_request():
    r = _req(SamplingParams(temperature=0.5, logit_bias={3: 1.0}, allowed_token_ids=[3, 4]))
    SamplingMetadata.build([r], V, "cpu")
    cached = dict(r.extra)
    SamplingMetadata.build([r], V, "cpu")
    assert all(r.extra[k] is cached[k] for k in cached)


@pytest.mark.parametrize("kw, field", [
    (dict(logit_bias={V: 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={1: 100.5}), "logit_bias"),
    (dict(logit_bias={1: math.nan}), "logit_bias"),
    (dict(logit_bias={1: math.inf}), "logit_bias"),
    (dict(logit_bias={"1": 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[V]), "allowed_token_ids"),
    (dict(allowed_token_ids=[True]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1] * (V + 1)), "allowed_token_ids"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[V]]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[1]] * 1025), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[1]), "bad_words_token_ids"),
])
def test_bad_controls_are_refused_naming_the_field(kw, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kw).validate(V)


def test_controls_travel_the_wire():
    params = SamplingParams(logit_bias={5: -100.0, 7: 2.5}, allowed_token_ids=[5, 7, 9],
                            bad_words_token_ids=[[9], [1, 2]])
    ecr = EngineCoreRequest(request_id="r", prompt_token_ids=[1], sampling_params=params, eos_token_id=EOS)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(ecr), type=EngineCoreRequest).sampling_params
    assert back == params
    back.validate(V)
    # none set: nothing extra on the wire
    assert b"logit_bias" not in msgspec.msgpack.encode(SamplingParams())
