"""The request-level sampler (engine/sampler.py) on SamplingMetadata: greedy, filters, seeds
and replay, penalties, min_tokens, logprobs records. The tensor kernels it calls are tested
in tests/kernels/test_sampling.py."""

from __future__ import annotations

import math

import pytest
import torch

from planaria.engine.request import Request
from planaria.engine.sampler import Sampler
from planaria.engine.sampling_metadata import PRIOR_OUTPUT_TOKENS_KEY, SamplingMetadata
from planaria.engine.sampling_params import SamplingParams

V = 64
EOS = 3


def _req(params: SamplingParams, prompt=(1, 2, 5), output=(), rid="r") -> Request:
    r = Request(rid, list(prompt), params, EOS, max_tokens=100)
    for t in output:
        r.append_output_token(t)
    return r


def _sample(logits, reqs):
    md = SamplingMetadata.build(reqs, logits.shape[1], "cpu")
    return Sampler()(logits, md)


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, V, generator=g) * 3  # [N, V]


def test_greedy_is_argmax_on_the_fast_path(logits):
    reqs = [_req(SamplingParams(temperature=0)) for _ in range(8)]
    md = SamplingMetadata.build(reqs, V, "cpu")
    assert md.plain_greedy and md.temperature is None and md.penalties is None
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                                    SamplingParams(top_k=1, top_p=0.5, min_p=0.1),
                                    SamplingParams(min_p=1.0)])
def test_filters_down_to_one_token_equal_greedy(logits, params):
    torch.manual_seed(1)
    for _ in range(5):
        out = _sample(logits, [_req(params) for _ in range(8)])
        assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def _draws(row_logits, params, n=4000):
    torch.manual_seed(123)
    x = row_logits.expand(n, -1).contiguous()  # [n, V]
    out = _sample(x, [_req(params, rid=str(i)) for i in range(n)])
    return torch.bincount(out.sampled_token_ids, minlength=x.shape[1])


def test_min_p_filters_unlikely_tokens():
    row = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]))
    counts = _draws(row, SamplingParams(min_p=0.15))  # threshold 0.075
    assert counts[3] == 0 and counts[4] == 0 and counts[:3].min() > 0


def test_top_k_and_top_p_keep_the_right_sets():
    row = torch.log(torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1]))
    assert set(_draws(row, SamplingParams(top_k=2)).nonzero().flatten().tolist()) == {1, 2}
    # top_p=0.8: 0.4 + 0.3 = 0.7 < 0.8, so 0.15 is kept too
    assert set(_draws(row, SamplingParams(top_p=0.8)).nonzero().flatten().tolist()) == {1, 2, 3}
    assert set(_draws(row, SamplingParams(top_p=0.8, top_k=2)).nonzero().flatten().tolist()) == {1, 2}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_the_softmax_distribution(temperature):
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n = 20000
    counts = _draws(row, SamplingParams(temperature=temperature), n=n).double()
    expected = torch.softmax(row.double() / temperature, -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0  # 5 dof: p < 1e-4 of failing by chance


def test_seeded_rows_reproduce_regardless_of_batch():
    g = torch.Generator().manual_seed(7)
    row = torch.randn(V, generator=g)
    seeded = SamplingParams(temperature=1.0, seed=42, top_p=0.95)

    def token(batch_logits, reqs, idx):
        torch.manual_seed(int(torch.randint(0, 10**6, ()).item()))  # global RNG differs each call
        return int(_sample(batch_logits, reqs).sampled_token_ids[idx])

    outputs = tuple(range(10, 17))  # step 7: seven tokens already produced
    alone = token(row[None], [_req(seeded, output=outputs)], 0)
    others = torch.randn(5, V, generator=g)
    batch = torch.cat([others[:3], row[None], others[3:]])  # [6, V], our row at index 3
    mates = [_req(SamplingParams(temperature=0.7)) for _ in range(3)] + [_req(SamplingParams(temperature=0))] * 2
    reqs = mates[:3] + [_req(seeded, output=outputs)] + mates[3:]
    for _ in range(3):
        assert token(batch, reqs, 3) == alone
    # replay: the same request resubmitted as prompt + produced tokens lands on the same draw
    replay = _req(seeded, prompt=(1, 2, 5) + outputs)
    replay.extra[PRIOR_OUTPUT_TOKENS_KEY] = len(outputs)
    assert token(row[None], [replay], 0) == alone


def test_seeds_differ_per_step_and_per_seed():
    row = torch.zeros(1, 1000)  # uniform: every draw is the race alone
    def tok(seed, step):
        return int(_sample(row, [_req(SamplingParams(seed=seed), output=[7] * step)]).sampled_token_ids[0])
    by_step = {tok(1, s) for s in range(20)}
    by_seed = {tok(s, 3) for s in range(20)}
    assert len(by_step) > 10 and len(by_seed) > 10
    assert tok(5, 4) == tok(5, 4)


def _reference_penalties(row, prompt, output, rep, pres, freq):
    row = row.clone()
    for t in set(prompt) | set(output):
        row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
    for t in set(output):
        row[t] -= pres + freq * output.count(t)
    return row


def test_penalties_match_a_direct_computation(logits):
    prompt, output = (1, 2, 5, 9), (5, 9, 9, 11, 11, 11)
    params = SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.25, logprobs=V)
    reqs = [_req(SamplingParams(temperature=0)), _req(params, prompt, output)]
    out = _sample(logits[:2], reqs)
    want = _reference_penalties(logits[1], prompt, list(output), 1.3, 0.5, 0.25)
    lp = out.logprobs[1]
    assert out.logprobs[0] is None
    got = torch.full((V,), float("nan"))
    got[torch.tensor(lp.token_ids[1:])] = torch.tensor(lp.logprobs[1:])
    torch.testing.assert_close(got, torch.log_softmax(want, -1), rtol=1e-5, atol=1e-5)
    assert int(out.sampled_token_ids[1]) == int(want.argmax())
    assert int(out.sampled_token_ids[0]) == int(logits[0].argmax())


def test_min_tokens_masks_eos_and_stop_ids():
    row = torch.zeros(1, V)
    row[0, EOS], row[0, 7], row[0, 8] = 10.0, 9.0, 8.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7])
    assert int(_sample(row, [_req(params, output=[1])]).sampled_token_ids[0]) == 8
    assert int(_sample(row, [_req(params, output=[1, 1])]).sampled_token_ids[0]) == EOS
    ignore = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7], ignore_eos=True)
    assert int(_sample(row, [_req(ignore)]).sampled_token_ids[0]) == EOS  # eos is not a stop here


def test_logprobs_values_and_rank(logits):
    torch.manual_seed(3)
    reqs = [_req(SamplingParams(logprobs=3, temperature=0.8), rid=str(i)) for i in range(6)]
    reqs += [_req(SamplingParams(logprobs=0, temperature=0)), _req(SamplingParams())]
    out = _sample(logits, reqs)
    ref = torch.log_softmax(logits, -1)  # [N, V]
    assert out.logprobs[7] is None
    for i, lp in enumerate(out.logprobs[:7]):
        tok = int(out.sampled_token_ids[i])
        n = 3 if i < 6 else 0
        assert len(lp.token_ids) == len(lp.logprobs) == n + 1 and lp.token_ids[0] == tok
        top = ref[i].topk(n)
        assert lp.token_ids[1:] == top.indices.tolist()
        assert lp.logprobs == pytest.approx([float(ref[i, tok])] + top.values.tolist(), abs=1e-5)
        assert lp.sampled_rank == int((ref[i] >= ref[i, tok]).sum())
    assert out.logprobs[6].sampled_rank == 1


def test_mixed_greedy_and_random_rows(logits):
    torch.manual_seed(5)
    greedy = SamplingParams(temperature=0)
    reqs = [greedy if i % 2 else SamplingParams(temperature=1.5) for i in range(8)]
    md = SamplingMetadata.build([_req(p, rid=str(i)) for i, p in enumerate(reqs)], V, "cpu")
    assert not md.all_greedy and not md.all_random
    seen_random = set()
    for _ in range(20):
        out = Sampler()(logits, md).sampled_token_ids
        assert torch.equal(out[1::2], logits[1::2].argmax(-1))
        seen_random.add(tuple(out[0::2].tolist()))
    assert len(seen_random) > 1
    assert all(0 <= t < V for row in seen_random for t in row)


def test_metadata_caches_row_constants():
    r = _req(SamplingParams(temperature=0.5, top_k=5))
    SamplingMetadata.build([r], V, "cpu")
    cached = dict(r.extra)
    SamplingMetadata.build([r], V, "cpu")
    assert r.extra.keys() == cached.keys() and all(r.extra[k] is cached[k] for k in cached)
    assert math.isclose(SamplingMetadata.build([r], V, "cpu").temperature.item(), 0.5)


@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 1e300])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1e300])
def test_extreme_penalties_never_pick_a_masked_token(penalty, temperature):
    """A grammar leaves tokens 7 and 8 (-inf elsewhere). 5e-324 is 0 in float32 and -inf * 0
    is NaN, which argmax takes (the fuzz's 500s); 1e300 is inf and 0 * inf is NaN too."""
    row = torch.full((1, V), float("-inf"))
    row[0, 7], row[0, 8] = 1.5, -0.5
    params = SamplingParams(temperature=temperature, repetition_penalty=penalty, presence_penalty=0.1)
    params.validate(V)
    for seed in range(20):
        torch.manual_seed(seed)
        # the prompt holds 7, 8 and masked tokens: every branch of the repetition penalty
        token = int(_sample(row.clone(), [_req(params, prompt=(1, 7, 8, 9), output=(8,))]).sampled_token_ids[0])
        assert token in (7, 8)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_numbers_are_refused(field, value):
    from planaria.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value}).validate(V)


def test_plain_greedy_batches_take_the_argmax_inside_the_lm_head(tiny_moe, monkeypatch):
    """A plain greedy batch gets its tokens from model.greedy_tokens (with the C++ kernels
    and more rows than the skinny linear takes, the argmax inside the lm_head a vocab chunk
    at a time: kernels/linear.py); a batch that asks for logprobs from the logits and the
    sampler. Both give the same tokens."""
    from planaria.engine import LLM
    from planaria.kernels import cpu_ext
    from planaria.kernels import linear as lin

    # the default kernels (the batch-invariant mode takes the logits whole: its own tests)
    llm = LLM(tiny_moe, max_num_seqs=80, kv_cache_bytes=2**24, batch_invariant=False)
    model = llm.core.runner.model
    rows, fused = [], []
    real_greedy = model.greedy_tokens
    monkeypatch.setattr(model, "greedy_tokens", lambda h: rows.append(h.shape[0]) or real_greedy(h))
    if cpu_ext.available():  # the fused op on the weight, or on its oneDNN-packed chunks
        for name in ("linear_argmax", "packed_linear_argmax"):
            real_op = getattr(torch.ops.planaria, name)
            monkeypatch.setattr(torch.ops.planaria, name, lambda *a, _r=real_op: fused.append(a[0].shape[0]) or _r(*a))
    packed = model.lm_head_packed is not None
    n = lin.max_rows(model.lm_head_weight().dtype, packed) + 4  # a batch past the skinny kernel's rows
    prompts = [[(7 * i + j) % 200 + 5 for j in range(6 + i % 5)] for i in range(n)]
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert rows and max(rows) == n
    # (a packed lm_head of one chunk, a vocab of at most packing.LM_HEAD_CHUNK rows: the logits whole)
    assert not cpu_ext.available() or (packed and len(model.lm_head_packed) == 1) or max(fused) == n
    rows.clear()
    asked = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1))
    assert rows == []  # logprobs need the logits
    assert [o.token_ids for o in plain] == [o.token_ids for o in asked]
    assert all(len(o.token_ids) == 8 for o in plain)
