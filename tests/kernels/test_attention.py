"""Paged attention (kernels/attention.py) on CPU: decodes and prefill chunks mixed in one
batch, scattered block tables, a cached prefix, and a prefix written by the same batch,
against naive causal attention (tests/kernels/_cases.py)."""

import pytest
import torch

from planaria.kernels import cpu_ext
from planaria.kernels.attention import build_metadata, paged_attention
from tests.kernels._cases import attention_case, attention_inputs, attention_reference, slots_of


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (4, 4), (8, 1)])
def test_mixed_batch_matches_naive_causal_attention(num_heads, num_kv_heads):
    case = attention_case(seed=num_heads * 10 + num_kv_heads, num_heads=num_heads, num_kv_heads=num_kv_heads)
    (q, k, v, k_cache, v_cache, md), pick = attention_inputs(case, "cpu", torch.float32)
    assert md.num_decode == 3 and len(md.prefills) == 3
    assert [p.mask is None for p in md.prefills] == [True, False, False]  # both prefill paths
    out = paged_attention(q, k, v, k_cache, v_cache, md, case.scale)
    ref = attention_reference(case, pick)
    assert out.shape == ref.shape == q.shape
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_new_tokens_are_written_to_their_slots():
    case = attention_case(seed=3)
    (q, k, v, k_cache, v_cache, md), pick = attention_inputs(case, "cpu", torch.float32)
    paged_attention(q, k, v, k_cache, v_cache, md, case.scale)
    for i in pick:
        s = case.seqs[i]
        idx = torch.tensor(slots_of(s, case.block_size, range(s.ctx_len)))
        assert torch.equal(k_cache[idx], case.k_full[i])  # cached prefix + this step's tokens
        assert torch.equal(v_cache[idx], case.v_full[i])


def test_metadata_slots_follow_the_block_tables():
    md = build_metadata([[5, 2], [7]], [6, 3], [([9, 4, 1], 5, 4)], 4, torch.device("cpu"))
    # decode rows: the last token's slot; prefill: slots of tokens 5..8
    assert md.slot_mapping.tolist() == [2 * 4 + 1, 7 * 4 + 2, 4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 1 * 4 + 0]
    assert md.decode_blocks.tolist() == [[5, 2], [7, 0]]
    assert md.decode_mask.view(2, -1).sum(1).tolist() == [6, 3]
    assert md.decode_mask.view(2, -1)[0].tolist() == [True] * 6 + [False] * 2
    assert md.prefills[0].mask.shape == (4, 9) and md.prefills[0].slots.tolist()[:5] == [36, 37, 38, 39, 16]


@pytest.fixture(params=["torch", "cpp"])
def decode_path(request, monkeypatch):
    """The torch matmul path (_decode_gqa) and the C++ in-place kernel
    (kernels/csrc/decode_attention.cpp, built here if `make venv` has not)."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_ext, "enabled", False)
    else:
        monkeypatch.setattr(cpu_ext, "enabled", True)
        cpu_ext.build()
        assert cpu_ext.available(), cpu_ext.status()
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (4, 4), (8, 1), (9, 3)])
def test_half_precision_decode_path_matches_sdpa_and_the_naive_reference(dtype, num_heads, num_kv_heads,
                                                                          decode_path):
    # bf16/fp16 decode rows on CPU take the C++ kernel or _decode_gqa (two matmuls, float32
    # softmax) instead of SDPA's CPU flash kernel; prefill rows keep SDPA. Both against
    # float64 attention and against SDPA run on the same half-precision inputs.
    case = attention_case(seed=num_heads * 7 + num_kv_heads, num_heads=num_heads, num_kv_heads=num_kv_heads)
    (q, k, v, k_cache, v_cache, md), pick = attention_inputs(case, "cpu", dtype)
    out = paged_attention(q, k, v, k_cache, v_cache, md, case.scale)
    assert (md.decode_bias is None) == (decode_path == "cpp")  # which path ran
    ref = attention_reference(case, pick)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    B = md.num_decode
    NB = md.decode_blocks.shape[1]
    bs = md.decode_mask.shape[-1] // NB
    kd = k_cache.view(-1, bs, *k_cache.shape[1:]).index_select(0, md.decode_blocks.reshape(-1))
    vd = v_cache.view(-1, bs, *v_cache.shape[1:]).index_select(0, md.decode_blocks.reshape(-1))
    kd = kd.view(B, NB * bs, *k_cache.shape[1:]).transpose(1, 2)
    vd = vd.view(B, NB * bs, *v_cache.shape[1:]).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[:B].unsqueeze(2), kd, vd, attn_mask=md.decode_mask, scale=case.scale, enable_gqa=True).squeeze(2)
    torch.testing.assert_close(out[:B].float(), sdpa.float(), rtol=1e-2, atol=1e-2)
