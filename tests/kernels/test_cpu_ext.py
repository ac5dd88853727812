"""The C++ decode attention kernel (kernels/csrc/decode_attention.cpp, built by
kernels/cpu_ext.py) against float64 attention over the same paged cache, and its argument
checks: a bad block table or length is an error, never a read outside the cache."""

import pytest
import torch

from planaria.kernels import cpu_ext


@pytest.fixture(scope="module", autouse=True)
def built():
    cpu_ext.build()
    assert cpu_ext.available(), cpu_ext.status()


def _case(seed, B, Hq, Hkv, D, block_size, lens, dtype):
    g = torch.Generator().manual_seed(seed)
    nb = max(-(-n // block_size) for n in lens)
    num_blocks = B * nb + 3
    k_cache = torch.randn(num_blocks * block_size, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, Hkv, D, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:B * nb].view(B, nb).contiguous()
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.long)


def _reference(q, k_cache, v_cache, tables, lens, block_size, scale):
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        slots = torch.tensor([int(tables[b, t // block_size]) * block_size + t % block_size for t in range(n)])
        k = k_cache[slots].double().repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
        v = v_cache[slots].double().repeat_interleave(Hq // Hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), k) * scale, dim=-1)
        out[b] = torch.einsum("ht,thd->hd", p, v)
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("Hq, Hkv", [(4, 4), (8, 2), (9, 3), (8, 1)])
def test_matches_float64_attention_over_the_paged_cache(dtype, tol, Hq, Hkv):
    lens = [1, 16, 17, 100, 333]
    q, kc, vc, tables, ctx = _case(Hq * 10 + Hkv, len(lens), Hq, Hkv, 64, 16, lens, dtype)
    out = torch.empty_like(q)
    torch.ops.planaria.decode_attention(q, kc, vc, tables, ctx, 16, 0.125, out)
    ref = _reference(q, kc, vc, tables, ctx, 16, 0.125)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_slots_past_a_sequence_are_not_read():
    # a NaN in every slot past each sequence's length (the block's tail, the padding of a
    # shorter table) must not reach the output
    q, kc, vc, tables, ctx = _case(3, 2, 4, 2, 32, 8, [5, 20], torch.bfloat16)
    ref = torch.empty_like(q)
    torch.ops.planaria.decode_attention(q, kc, vc, tables, ctx, 8, 0.2, ref)
    used = set()
    for b, n in enumerate(ctx.tolist()):
        used |= {int(tables[b, t // 8]) * 8 + t % 8 for t in range(n)}
    for s in range(kc.shape[0]):
        if s not in used:
            kc[s] = float("nan")
            vc[s] = float("nan")
    out = torch.empty_like(q)
    torch.ops.planaria.decode_attention(q, kc, vc, tables, ctx, 8, 0.2, out)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("bad, match", [
    ("block", "block id outside the cache"), ("negative", "block id outside the cache"),
    ("len0", "ctx_len"), ("len_long", "ctx_len"), ("dtype", "one dtype"), ("heads", "multiple of Hkv"),
])
def test_bad_arguments_are_errors(bad, match):
    q, kc, vc, tables, ctx = _case(5, 2, 4, 2, 32, 8, [5, 12], torch.bfloat16)
    out = torch.empty_like(q)
    if bad == "block":
        tables[1, 1] = kc.shape[0] // 8
    elif bad == "negative":
        tables[0, 0] = -1
    elif bad == "len0":
        ctx[0] = 0
    elif bad == "len_long":
        ctx[1] = tables.shape[1] * 8 + 1
    elif bad == "dtype":
        q = q.float()
        out = torch.empty_like(q)
    elif bad == "heads":
        q = q[:, :3].contiguous()
        out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.planaria.decode_attention(q, kc, vc, tables, ctx, 8, 0.2, out)


def test_switch_and_status(monkeypatch):
    monkeypatch.setenv(cpu_ext.ENV, "0")
    assert not cpu_ext.available() and "off" in cpu_ext.status()
    monkeypatch.delenv(cpu_ext.ENV)
    assert cpu_ext.available() and cpu_ext.status() == "loaded"
    assert cpu_ext.library_path().parent.name == cpu_ext.tag()
