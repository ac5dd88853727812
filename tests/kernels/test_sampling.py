"""Sampling kernels (kernels/sampling.py) on plain tensors: argmax, penalties, masking,
top-k/top-p/min_p, the seeded exponential race, logprobs. The request-level sampler built
on them is tested in tests/engine/test_sampler.py."""

from __future__ import annotations

import pytest
import torch

from planaria.kernels.sampling import (apply_penalties, apply_top_k_top_p, argmax_rows,
                                       compute_logprobs, mask_tokens, sample_random)

V = 64
NEG_INF = float("-inf")


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, V, generator=g) * 3  # [N, V]


@pytest.mark.parametrize("vocab_size", [4096, 32000, 1000, 50257])
def test_argmax_rows_matches_torch_with_ties_and_nan(vocab_size):
    g = torch.Generator().manual_seed(vocab_size)
    x = torch.randint(0, 5, (6, vocab_size), generator=g).float()  # [6, V], many ties
    x[2, 17] = float("nan")
    x[3, vocab_size - 1] = 99.0
    assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_penalties_touch_only_their_rows_and_match_a_direct_computation(logits):
    prompts, outputs = [(1, 2, 5, 9), (0, 3)], [[5, 9, 9, 11, 11, 11], [3]]
    rep, pres, freq = [1.3, 2.0], [0.5, 0.0], [0.25, 1.0]
    width = max(map(len, outputs))
    before = logits.clone()
    prompt_mask = torch.zeros(2, V, dtype=torch.bool)
    for i, p in enumerate(prompts):
        prompt_mask[i, list(p)] = True
    out = apply_penalties(logits, torch.tensor([1, 4]), torch.tensor(rep), torch.tensor(pres),
                          torch.tensor(freq), prompt_mask,
                          torch.tensor([o + [V] * (width - len(o)) for o in outputs]))
    want = logits.clone()
    for i, row in enumerate((1, 4)):
        for t in set(prompts[i]) | set(outputs[i]):
            want[row, t] = want[row, t] / rep[i] if want[row, t] > 0 else want[row, t] * rep[i]
        for t in set(outputs[i]):
            want[row, t] -= pres[i] + freq[i] * outputs[i].count(t)
    torch.testing.assert_close(out, want)
    assert torch.equal(logits, before)  # out of place


def test_mask_tokens_sets_the_pairs_to_minus_inf(logits):
    out = mask_tokens(logits, torch.tensor([0, 0, 3]), torch.tensor([7, 9, 7]))
    assert out[0, 7] == out[0, 9] == out[3, 7] == NEG_INF
    assert torch.isfinite(out).sum() == logits.numel() - 3 and torch.isfinite(logits).all()


def test_top_k_top_p_keep_the_right_sets():
    row = torch.log(torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])).expand(4, -1)  # [4, 5]
    top_k = torch.tensor([2, 5, 2, 1])  # 5 = off
    top_p = torch.tensor([1.0, 0.8, 0.8, 1e-6])  # 1.0 = off; 0.4 + 0.3 < 0.8 keeps 0.15
    kept = [set(r.isfinite().nonzero().flatten().tolist()) for r in apply_top_k_top_p(row, top_k, top_p)]
    assert kept == [{1, 2}, {1, 2, 3}, {1, 2}, {1}]
    only_k = apply_top_k_top_p(row, top_k, None)
    assert [set(r.isfinite().nonzero().flatten().tolist()) for r in only_k] == [{1, 2}, set(range(5)), {1, 2}, {1}]
    assert apply_top_k_top_p(row, None, None) is row


def test_sample_random_filters_down_to_greedy(logits):
    n = logits.shape[0]
    ones = torch.ones(n)
    argmax = logits.argmax(-1)
    assert torch.equal(sample_random(logits, ones, top_k=torch.ones(n, dtype=torch.int64)), argmax)
    assert torch.equal(sample_random(logits, ones, top_p=torch.full((n,), 1e-6)), argmax)
    assert torch.equal(sample_random(logits, ones, min_p=torch.ones(n)), argmax)


def test_sample_random_follows_the_tempered_softmax():
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n, temperature = 20000, 0.5
    torch.manual_seed(11)
    tokens = sample_random(row.expand(n, -1).contiguous(), torch.full((n,), temperature))
    counts = torch.bincount(tokens, minlength=6).double()
    expected = torch.softmax(row.double() / temperature, -1) * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 25.0  # 5 dof: p < 1e-4


def test_seeded_rows_do_not_depend_on_the_batch_or_global_rng():
    g = torch.Generator().manual_seed(7)
    batch = torch.randn(5, V, generator=g)
    temps = torch.ones(5)
    torch.manual_seed(1)
    alone = sample_random(batch[3:4], temps[:1], seeds=[(0, 1234)])
    torch.manual_seed(2)
    together = sample_random(batch, temps, seeds=[(3, 1234), (1, 99)])
    assert int(together[3]) == int(alone[0])
    uniform = torch.zeros(20, 1000)  # every draw is the race alone
    assert len(set(sample_random(uniform, torch.ones(20), seeds=[(i, i) for i in range(20)]).tolist())) > 10


@pytest.mark.parametrize("num_top", [0, 3])
def test_compute_logprobs_values_ranks_and_top(logits, num_top):
    sampled = torch.tensor([0, 5, logits[2].argmax(), 7, 1, 2])
    rows = torch.tensor([0, 2, 5])
    lp = compute_logprobs(logits, sampled, rows, num_top)
    ref = torch.log_softmax(logits, -1)  # [N, V]
    assert lp.token_ids.tolist() == [0, int(logits[2].argmax()), 2]
    torch.testing.assert_close(lp.logprobs, ref[rows, lp.token_ids])
    assert lp.ranks.tolist() == [int((ref[r] >= ref[r, t]).sum()) for r, t in zip(rows.tolist(), lp.token_ids)]
    assert lp.ranks[1] == 1  # the argmax ranks first
    top = ref[rows].topk(num_top)
    assert lp.top_token_ids.shape == (3, num_top) and torch.equal(lp.top_token_ids, top.indices)
    torch.testing.assert_close(lp.top_logprobs, top.values)


def test_compute_logprobs_rejects_a_bad_top_n(logits):
    with pytest.raises(ValueError, match="num_top"):
        compute_logprobs(logits, logits.argmax(-1), torch.tensor([0]), V + 1)
