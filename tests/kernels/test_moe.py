"""MoE routing and the grouped expert matmul (kernels/moe.py) on CPU against a per-token
loop (tests/kernels/_cases.py): the batched-matmul path, the per-expert fallback (few
experts active, skewed routing), and an expert-parallel rank's share."""

import pytest
import torch

from planaria.kernels import cpu_ext, moe
from planaria.kernels.moe import grouped_expert_mlp, route
from tests.kernels._cases import moe_case, moe_reference, route_reference


@pytest.fixture(autouse=True)
def torch_code(monkeypatch):
    """This file tests the torch code; the C++ kernel that replaces it at small batches
    on the CPU is checked against it in test_cpu_ext.py."""
    monkeypatch.setattr(cpu_ext, "enabled", False)


@pytest.fixture
def bmm_calls(monkeypatch):
    """Counts torch.bmm calls (the real bmm still runs) to tell the two paths apart."""
    calls = []
    real = torch.bmm

    def spy(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(moe.torch, "bmm", spy)
    return calls


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_softmax_topk(renormalize):
    case = moe_case(50, seed=1)
    w, ids = route(case.router_logits, case.top_k, renormalize)
    rw, rids = route_reference(case.router_logits, case.top_k, renormalize)
    assert torch.equal(ids, rids) and ids.dtype == torch.int64
    torch.testing.assert_close(w.double(), rw, rtol=1e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(50))


@pytest.mark.parametrize("num_tokens, favour, path", [
    (64, None, "bmm"),  # every expert has tokens: one padded batched matmul per projection
    (300, None, "bmm"),
    (1, None, "loop"),  # decode at batch 1: top_k of 8 experts active
    (2, None, "loop"),  # 4 pairs: at most 4 of 8 experts active
    (64, [2, 5], "loop"),  # skewed: every token routed to experts 2 and 5
])
def test_grouped_expert_mlp_matches_per_token_loop(bmm_calls, num_tokens, favour, path):
    case = moe_case(num_tokens, seed=num_tokens, favour=favour)
    w, ids = route(case.router_logits, case.top_k, True)
    out = grouped_expert_mlp(case.x, case.w13, case.w2, w, ids)
    assert (len(bmm_calls) == 2) == (path == "bmm"), bmm_calls
    if favour:
        assert set(ids.unique().tolist()) == set(favour)
    torch.testing.assert_close(out.double(), moe_reference(case, w, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 64])
def test_expert_parallel_share_sums_to_the_whole(bmm_calls, num_tokens):
    case = moe_case(num_tokens, seed=7)
    w, ids = route(case.router_logits, case.top_k, True)
    lo = grouped_expert_mlp(case.x, case.w13[:4], case.w2[:4], w, ids, expert_offset=0)
    hi = grouped_expert_mlp(case.x, case.w13[4:], case.w2[4:], w, ids, expert_offset=4)
    torch.testing.assert_close(hi.double(), moe_reference(case, w, ids, experts=range(4, 8)),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((lo + hi).double(), moe_reference(case, w, ids), rtol=1e-5, atol=1e-5)


def test_no_local_pairs_gives_zeros():
    case = moe_case(4, seed=2, favour=[0, 1])
    w, ids = route(case.router_logits, case.top_k, True)
    out = grouped_expert_mlp(case.x, case.w13[4:], case.w2[4:], w, ids, expert_offset=4)
    assert torch.equal(out, torch.zeros_like(case.x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, offset, num_local", [(1, 0, 8), (2, 0, 8), (4, 0, 8), (3, 4, 4), (4, 2, 2)])
def test_few_pairs_path_equals_the_general_loop_bit_for_bit(monkeypatch, dtype, num_tokens, offset, num_local):
    # decode at one to four tokens groups its pairs in Python (_few_pairs); the general
    # path's per-expert loop must give the very same tensor, on a full engine and on an
    # expert-parallel rank's slice of the experts
    case = moe_case(num_tokens, seed=11 + num_tokens)
    w, ids = route(case.router_logits.to(dtype), case.top_k, True)
    args = (case.x.to(dtype), case.w13[offset:offset + num_local].to(dtype),
            case.w2[offset:offset + num_local].to(dtype), w, ids, offset)
    calls = []
    real = moe._few_pairs
    monkeypatch.setattr(moe, "_few_pairs", lambda *a: calls.append(1) or real(*a))
    fast = grouped_expert_mlp(*args)
    assert calls, "the few-pairs path did not run"
    monkeypatch.setattr(moe, "_FEW_PAIRS", 0)
    general = grouped_expert_mlp(*args)
    assert len(calls) == 1
    assert torch.equal(fast, general)
