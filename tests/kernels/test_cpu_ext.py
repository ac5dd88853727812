"""The C++ CPU kernels (kernels/csrc/, built by kernels/cpu_ext.py) against float64 or
the torch code: decode attention over the paged cache, fused MoE, RMSNorm, argmax; and
their argument checks: a bad block table or length is an error, never a read outside the
cache."""

import pytest
import torch
import torch.nn.functional as F

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


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("Hq, Hkv, D", [(10, 2, 80), (8, 4, 128), (6, 1, 40), (3, 3, 16), (6, 2, 36), (9, 3, 96)])
def test_head_sizes_and_group_sizes(dtype, tol, Hq, Hkv, D):
    # head sizes past one 64-value block or with a vector tail, groups of query heads past
    # four (the kernel holds up to 4 heads x 64 values in registers), 16-key groups' tails
    lens = [1, 15, 33, 130]
    q, kc, vc, tables, ctx = _case(Hq + D, len(lens), Hq, Hkv, D, 8, lens, dtype)
    out = torch.empty_like(q)
    torch.ops.planaria.decode_attention(q, kc, vc, tables, ctx, 8, D ** -0.5, out)
    ref = _reference(q, kc, vc, tables, ctx, 8, D ** -0.5)
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
    monkeypatch.setattr(cpu_ext, "enabled", False)
    assert not cpu_ext.available() and "off" in cpu_ext.status()
    monkeypatch.setattr(cpu_ext, "enabled", True)
    assert cpu_ext.available() and cpu_ext.status() == "loaded"
    assert cpu_ext.library_path().parent.name == cpu_ext.tag()


def _moe_reference(x, w13, w2, weights, ids, offset):
    """float64, from the same (rounded) inputs: per token, per local expert chosen."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - offset
            if 0 <= e < w13.shape[0]:
                gu = w13[e].double() @ x[t].double()
                out[t] += float(weights[t, j]) * (w2[e].double() @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("num_tokens", [1, 3, 9, 40])
@pytest.mark.parametrize("offset, num_local", [(0, 8), (3, 3)])  # all experts; an EP rank's slice
def test_fused_moe_matches_float64_experts(dtype, tol, num_tokens, offset, num_local):
    # hidden 80 and intermediate 48: not multiples of the 32-wide dot (its tail is exercised)
    g = torch.Generator().manual_seed(num_tokens * 10 + offset)
    H, inter, E, K = 80, 48, 8, 2
    x = torch.randn(num_tokens, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5).to(dtype)[offset:offset + num_local].contiguous()
    w2 = (torch.randn(E, H, inter, generator=g) / inter ** 0.5).to(dtype)[offset:offset + num_local].contiguous()
    weights, ids = torch.softmax(torch.randn(num_tokens, E, generator=g), -1).topk(K, dim=-1)
    out = torch.full_like(x, float("nan"))
    torch.ops.planaria.fused_moe(x, w13, w2, weights, ids, offset, out)
    ref = _moe_reference(x, w13, w2, weights, ids, offset)
    scale = ref.abs().max().item() + 1e-6
    torch.testing.assert_close(out.double() / scale, ref / scale, rtol=tol, atol=tol)


def test_grouped_expert_mlp_takes_the_kernel_for_small_bf16_batches(monkeypatch):
    from planaria.kernels import moe

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g).bfloat16()
    w13 = torch.randn(4, 64, 64, generator=g).bfloat16() / 8
    w2 = torch.randn(4, 64, 32, generator=g).bfloat16() / 8
    weights, ids = torch.softmax(torch.randn(6, 4, generator=g), -1).topk(2, dim=-1)
    expected = torch.empty_like(x)
    torch.ops.planaria.fused_moe(x, w13, w2, weights, ids, 0, expected)
    got = moe.grouped_expert_mlp(x, w13, w2, weights, ids)
    assert torch.equal(got, expected)
    monkeypatch.setattr(moe, "_CPP_PAIRS_PER_EXPERT", 1)  # 12 pairs > 1 * 4 experts: the torch code
    torch_path = moe.grouped_expert_mlp(x, w13, w2, weights, ids)
    assert not torch.equal(torch_path, expected)  # bf16 intermediates there, float32 in the kernel
    torch.testing.assert_close(torch_path.float(), expected.float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("bad, match", [
    ("shape", "weight shapes"), ("ids", "int64"), ("dtype", "one dtype"), ("topk", "topk shapes"),
])
def test_fused_moe_bad_arguments_are_errors(bad, match):
    x = torch.randn(2, 32).bfloat16()
    w13, w2 = torch.randn(4, 64, 32).bfloat16(), torch.randn(4, 32, 32).bfloat16()
    weights, ids = torch.rand(2, 2), torch.tensor([[0, 1], [2, 3]])
    if bad == "shape":
        w2 = torch.randn(4, 32, 16).bfloat16()
    elif bad == "ids":
        ids = ids.int()
    elif bad == "dtype":
        w13 = w13.float()
    elif bad == "topk":
        weights = torch.rand(2, 3)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.planaria.fused_moe(x, w13, w2, weights, ids, 0, torch.empty_like(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 512), (37, 80), (300, 576)])
def test_rms_norm_matches_the_torch_code(monkeypatch, dtype, shape):
    from planaria.kernels.norm import rms_norm

    g = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    got = rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    monkeypatch.setattr(cpu_ext, "enabled", False)
    ref = rms_norm(x, w, 1e-6)
    # the same rounding steps; a sum of squares in another order may move a value by one ulp
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    if dtype != torch.float32:  # float32: one rsqrt in the last bit moves the whole row by an ulp
        assert (got == ref).float().mean() > 0.99


def test_rms_norm_reads_heads_out_of_the_fused_projection(monkeypatch):
    from planaria.kernels.norm import rms_norm

    qkv = torch.randn(5, 8 * 16 + 2 * 2 * 16).bfloat16()
    q = qkv[:, :8 * 16].view(5, 8, 16)  # rows of 16 with a token stride of 192: not contiguous
    w = torch.rand(16).bfloat16() + 0.5
    got = rms_norm(q, w, 1e-5)
    monkeypatch.setattr(cpu_ext, "enabled", False)
    assert got.is_contiguous()
    torch.testing.assert_close(got.float(), rms_norm(q, w, 1e-5).float(), rtol=1e-2, atol=1e-2)


def test_rms_norm_bad_arguments_are_errors():
    x = torch.randn(3, 8).bfloat16()
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.planaria.rms_norm(x, torch.ones(7).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.planaria.rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="last dim contiguous"):
        torch.ops.planaria.rms_norm(x.t(), torch.ones(3).bfloat16(), 1e-6)


def test_loading_the_library_leaves_subnormals_alone():
    # a .so linked with -ffast-math sets flush-to-zero for the whole process when loaded
    # (crtfastmath): every subnormal float in the engine would become 0
    import subprocess
    import sys

    code = ("import torch; from planaria.kernels import cpu_ext; assert cpu_ext.available(); "
            "x = torch.tensor([1e-40], dtype=torch.float32); assert (x * 1.0).item() != 0.0, 'FTZ'; "
            "assert 5e-324 * 1.0 > 0.0, 'DAZ'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tokens_gives_an_empty_result(dtype):
    # an idle expert-parallel rank's dummy step runs its MoE layers on zero tokens
    from planaria.kernels.moe import grouped_expert_mlp

    x = torch.empty(0, 32, dtype=dtype)
    w13, w2 = torch.randn(4, 64, 32).to(dtype), torch.randn(4, 32, 32).to(dtype)
    out = grouped_expert_mlp(x, w13, w2, torch.empty(0, 2, dtype=dtype), torch.empty(0, 2, dtype=torch.long), 4)
    assert out.shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 100), (5, 256), (7, 1000), (64, 49152)])
def test_argmax_matches_torch(dtype, shape):
    g = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(*shape, generator=g) * 4).to(dtype)
    assert torch.equal(torch.ops.planaria.argmax_rows(x), x.argmax(-1))
    x = torch.randint(-3, 4, shape, generator=g).to(dtype)  # many ties: the first index wins
    assert torch.equal(torch.ops.planaria.argmax_rows(x), x.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_nan_inf_and_signed_zeros(dtype):
    x = torch.randn(8, 700).to(dtype)
    x[1, 5] = x[1, 600] = float("nan")  # NaN counts as the maximum, the first one wins
    x[2] = 0.0
    x[2, 3] = -0.0  # -0 == +0: the first index
    x[3] = -0.0
    x[3, 10] = 0.0
    x[4] = float("-inf")
    x[5, 400] = x[5, 699] = float("inf")
    x[6] = x[6, 0]
    x[7, 699] = float("nan")  # in the last, partial chunk
    assert torch.equal(torch.ops.planaria.argmax_rows(x), x.argmax(-1))


def test_argmax_rows_takes_the_kernel_and_bad_arguments_are_errors(monkeypatch):
    from planaria.kernels.sampling import argmax_rows

    x = torch.randn(4, 4096).bfloat16()
    monkeypatch.setattr(cpu_ext, "enabled", False)
    ref = argmax_rows(x)  # the torch code (block maxima)
    monkeypatch.setattr(cpu_ext, "enabled", True)
    assert torch.equal(argmax_rows(x), ref)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.planaria.argmax_rows(x.t())
    with pytest.raises(RuntimeError, match="V > 0"):
        torch.ops.planaria.argmax_rows(torch.empty(3, 0))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.planaria.argmax_rows(torch.zeros(2, 3, dtype=torch.long))


# linear_argmax: greedy tokens straight from the lm_head, a vocab chunk at a time. Small
# integer inputs make every logit exact (float32 sums; bfloat16 / float16 round the same
# exact value), so the answer is defined exactly, ties across chunks included.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K,chunk", [(1, 1, 1, 256), (3, 1000, 64, 256), (9, 4097, 64, 1000),
                                         (5, 300, 33, 7), (64, 49152, 576, 1024), (2, 50, 16, 4096)])
def test_linear_argmax_exact_on_integer_logits(dtype, M, N, K, chunk):
    g = torch.Generator().manual_seed(M * 7 + N + K)
    x = torch.randint(-3, 4, (M, K), generator=g).to(dtype)
    w = torch.randint(-3, 4, (N, K), generator=g).to(dtype)
    ref = (x.double() @ w.double().t()).to(dtype).argmax(-1)  # the first index of the maximum
    assert torch.equal(torch.ops.planaria.linear_argmax(x, w, chunk), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_argmax_random_logits_pick_a_maximum(dtype):
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(16, 576, generator=g).to(dtype), torch.randn(49152, 576, generator=g).to(dtype)
    got = torch.ops.planaria.linear_argmax(x, w, 2048)
    exact = x.double() @ w.double().t()
    picked = exact.gather(1, got.unsqueeze(1)).squeeze(1)
    # sums in another order than float64's: the pick is the maximum up to rounding
    tol = 1e-4 if dtype == torch.float32 else 0.3
    assert ((exact.amax(-1) - picked) <= tol).all()
    assert (got == exact.argmax(-1)).float().mean() > 0.9


def test_linear_argmax_nan_and_bad_arguments():
    x = torch.randint(-3, 4, (4, 32)).float()
    w = torch.randint(-3, 4, (3000, 32)).float()
    w[1500, 0] = w[2999, 3] = float("nan")  # columns of NaN: the first one is every row's answer
    x[2] = float("nan")  # a row of NaN logits: index 0
    got = torch.ops.planaria.linear_argmax(x, w, 512)
    assert got.tolist() == [1500, 1500, 0, 1500]
    assert torch.ops.planaria.linear_argmax(torch.empty(0, 32), w, 512).shape == (0,)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.planaria.linear_argmax(torch.randn(32, 2).t(), w, 512)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.planaria.linear_argmax(torch.randn(2, 31), w, 512)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.planaria.linear_argmax(torch.randn(2, 32).bfloat16(), w, 512)
    with pytest.raises(RuntimeError, match="no rows"):
        torch.ops.planaria.linear_argmax(torch.randn(2, 32), torch.empty(0, 32), 512)
    with pytest.raises(RuntimeError, match="chunk"):
        torch.ops.planaria.linear_argmax(torch.randn(2, 32), w, 0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.planaria.linear_argmax(torch.zeros(2, 32, dtype=torch.long), w.long(), 512)


def test_greedy_tokens_take_the_fused_kernel_past_the_skinny_rows(monkeypatch):
    from planaria.kernels import linear as lin

    calls = []
    real = torch.ops.planaria.linear_argmax
    monkeypatch.setattr(torch.ops.planaria, "linear_argmax", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w = torch.randint(-3, 4, (5000, 64)).float()
    small = lin.max_rows(torch.float32)
    for m in (1, small, small + 1, 64):
        if m == 0:
            continue
        x = torch.randint(-3, 4, (m, 64)).float()
        assert torch.equal(lin.linear_argmax(x, w), (x @ w.t()).argmax(-1))
    assert calls == [m for m in (1, small + 1, 64) if m > small]
    calls.clear()
    x = torch.randint(-3, 4, (small + 1, 64)).float()  # past the skinny kernel's rows
    monkeypatch.setattr(cpu_ext, "enabled", False)  # no C++ kernels: the logits whole
    assert torch.equal(lin.linear_argmax(x, w), (x @ w.t()).argmax(-1))
    monkeypatch.setattr(cpu_ext, "enabled", True)
    # a oneDNN-packed lm_head of one chunk (packed without the C++ kernels): the logits
    # whole, through the packed GEMM
    packed_calls = []
    monkeypatch.setattr(lin, "packed_linear", lambda x, p, b=None: packed_calls.append(p) or F.linear(x, w))
    assert torch.equal(lin.linear_argmax(x, w, ["packed"]), (x @ w.t()).argmax(-1))
    assert calls == [] and packed_calls == ["packed"]


def _onednn_bf16():
    from planaria.engine.models import packing

    if not packing._onednn_packing(torch.bfloat16):
        pytest.skip("no oneDNN bf16 weight packing in this torch on this CPU (AVX2-only hosts)")
    return packing


# the lm_head packed as chunks of vocab rows (engine/models/packing.py pack_lm_head): the
# greedy argmax a chunk at a time and the whole logits are exactly what the packed GEMM
# of the whole weight gives, every chunk edge and a short last chunk included
@pytest.mark.parametrize("M,N,K,chunk", [(1, 300, 64, 64), (9, 4097, 64, 1024), (64, 5000, 96, 4096),
                                         (3, 50, 16, 4096), (17, 1000, 40, 7)])
def test_packed_lm_head_chunks_equal_the_whole_packed_gemm(M, N, K, chunk):
    packing = _onednn_bf16()
    g = torch.Generator().manual_seed(M + N)
    w = torch.randn(N, K, generator=g).bfloat16()
    chunks = [packing.pack(w[i:i + chunk]) for i in range(0, N, chunk)]
    whole = packing.pack(w)
    x = torch.randn(M, K, generator=g).bfloat16()
    ref = torch.ops.mkldnn._linear_pointwise(x, whole, None, "none", [], "")
    assert torch.equal(torch.ops.planaria.packed_linear_chunked(x, chunks, chunk, False), ref)
    assert torch.equal(torch.ops.planaria.packed_linear_chunked(x, chunks, chunk, True), ref.float())
    assert torch.equal(torch.ops.planaria.packed_linear_argmax(x, chunks, chunk), ref.argmax(-1))
    # ties across chunks: integer inputs, equal rows in two chunks -> the first index
    xi = torch.randint(-3, 4, (M, K), generator=g).bfloat16()
    wi = torch.randint(-3, 4, (N, K), generator=g).bfloat16()
    wi[N - 1] = wi[0]
    ci = [packing.pack(wi[i:i + chunk]) for i in range(0, N, chunk)]
    assert torch.equal(torch.ops.planaria.packed_linear_argmax(xi, ci, chunk),
                       (xi.double() @ wi.double().t()).bfloat16().argmax(-1))


def test_packed_lm_head_chunks_bad_arguments():
    packing = _onednn_bf16()
    w = torch.randn(100, 32).bfloat16()
    chunks = [packing.pack(w[i:i + 40]) for i in range(0, 100, 40)]  # 40, 40, 20
    x = torch.randn(2, 32).bfloat16()
    assert torch.ops.planaria.packed_linear_argmax(torch.empty(0, 32).bfloat16(), chunks, 40).shape == (0,)
    assert torch.ops.planaria.packed_linear_chunked(torch.empty(0, 32).bfloat16(), chunks, 40, True).shape == (0, 100)
    for op in (lambda *a: torch.ops.planaria.packed_linear_argmax(*a),
               lambda *a: torch.ops.planaria.packed_linear_chunked(*a, False)):
        with pytest.raises(RuntimeError, match="no weight chunks"):
            op(x, [], 40)
        with pytest.raises(RuntimeError, match="chunk > 0"):
            op(x, chunks, 0)
        with pytest.raises(RuntimeError, match="chunk 0 has 40 rows, not 30"):
            op(x, chunks, 30)  # the chunks are not of the size the call says
        with pytest.raises(RuntimeError, match="chunk 1 has 20 rows, not 40"):
            op(x, [chunks[0], chunks[2], chunks[1]], 40)  # a short chunk before the last
        with pytest.raises(RuntimeError, match="chunk 2 has 40 rows, not 1..30"):
            op(x, [packing.pack(w[:30]), packing.pack(w[:30]), chunks[0]], 30)  # a last chunk too long
        with pytest.raises(RuntimeError, match=r"is not \[rows, 31\]"):
            op(torch.randn(2, 31).bfloat16(), chunks, 40)
        with pytest.raises(RuntimeError, match="one dtype"):
            op(torch.randn(2, 32), chunks, 40)
        with pytest.raises(RuntimeError, match="contiguous"):
            op(torch.randn(32, 2).bfloat16().t(), chunks, 40)


def test_lm_head_routes_packed_chunks(monkeypatch):
    """kernels/linear.py: past the skinny rows, greedy rows of a chunked packed lm_head take
    packed_linear_argmax and sampled rows packed_linear_chunked; at the skinny rows the
    C++ linear reads the weight itself; every route gives the packed GEMM's answer."""
    from planaria.kernels import linear as lin

    packing = _onednn_bf16()
    monkeypatch.setattr(packing, "LM_HEAD_CHUNK", 256)
    w = torch.randn(1000, 64).bfloat16()
    chunks = packing.pack_lm_head(w)
    assert [c.shape[0] for c in chunks] == [256, 256, 256, 232]
    calls = []
    for name in ("packed_linear_argmax", "packed_linear_chunked"):
        real = getattr(torch.ops.planaria, name)
        monkeypatch.setattr(torch.ops.planaria, name,
                            lambda *a, _n=name, _r=real: calls.append((_n, a[0].shape[0])) or _r(*a))
    small = lin.max_rows(torch.bfloat16)
    for m in {1, max(small, 1), small + 1, 64}:
        x = torch.randn(m, 64).bfloat16()
        ref = F.linear(x, w)
        logits = lin.lm_head_logits(x, w, chunks)
        assert logits.dtype == torch.float32 and lin.lm_head_logits(x, w, chunks, float32=False).dtype == torch.bfloat16
        if m > small:
            assert torch.equal(logits, ref.float())
        else:  # the skinny kernel sums in another order
            torch.testing.assert_close(logits, ref.float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(lin.linear_argmax(x, w, chunks), lin.argmax_rows(lin.lm_head_logits(x, w, chunks, False)))
    past = [m for m in sorted({1, max(small, 1), small + 1, 64}) if m > small]
    assert sorted(c for c in calls if c[0] == "packed_linear_argmax") == [("packed_linear_argmax", m) for m in past]
    assert sum(c[0] == "packed_linear_chunked" for c in calls) == 3 * len(past)


# skinny_linear: every tail (rows of x past a multiple of 4, weight rows past a multiple
# of 4, K past a multiple of the 16 / 32 a vector holds), with and without bias
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3), (torch.float16, 1e-3)])
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 7, 33), (2, 9, 31), (3, 4, 64), (4, 13, 100), (5, 6, 17),
                                   (7, 129, 576), (16, 960, 576), (17, 33, 1536), (1, 49152, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_float64(dtype, tol, M, N, K, with_bias):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if with_bias else None
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    got = torch.ops.planaria.skinny_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (M, N)
    # one rounding to the dtype at the end, sums in float32: relative to the row's scale
    scale = ref.abs().amax(dim=1, keepdim=True).clamp_min(1.0)
    assert ((got.double() - ref).abs() / scale).max().item() < tol


def test_skinny_linear_no_rows_and_bad_arguments():
    w = torch.randn(8, 16)
    assert torch.ops.planaria.skinny_linear(torch.empty(0, 16), w, None).shape == (0, 8)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.planaria.skinny_linear(torch.randn(16, 2).t(), w, None)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.planaria.skinny_linear(torch.randn(2, 15), w, None)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.planaria.skinny_linear(torch.randn(2, 16).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.planaria.skinny_linear(torch.randn(2, 16), w, torch.randn(7))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.planaria.skinny_linear(torch.zeros(2, 16, dtype=torch.long), w.long(), None)


def test_linear_takes_the_kernel_up_to_max_rows(monkeypatch):
    from planaria.kernels import linear as lin

    calls = []
    real = torch.ops.planaria.skinny_linear
    monkeypatch.setattr(torch.ops.planaria, "skinny_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w, b = torch.randn(64, 96), torch.randn(64)
    limit = lin.max_rows(torch.float32)
    for m in (1, limit, limit + 1):
        x = torch.randn(max(m, 1), 96)
        assert torch.allclose(lin.linear(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-5)
    assert calls == [m for m in (1, limit) if 0 < m <= limit]
    monkeypatch.setattr(cpu_ext, "enabled", False)
    assert lin.max_rows(torch.float32) == 0
    lin.linear(torch.randn(1, 96), w, b)
    assert len(calls) == (2 if limit else 0)
    monkeypatch.setattr(cpu_ext, "enabled", True)
    assert lin.max_rows(torch.float16) == 0  # float16 keeps torch's GEMM
    if "avx512f" in cpu_ext.cpu_flags().split():
        assert limit == 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_on_rows_of_few_distinct_values(dtype):
    # many ties, signed zeros, all-negative rows, infinities, lengths off the vector width
    g = torch.Generator().manual_seed(7)
    pool = torch.tensor([-0.0, 0.0, -1.5, -3.0, -float("inf"), 2.0, float("inf"), -2.0e-3])
    for length in (1, 15, 16, 17, 31, 32, 33, 100, 1000):
        for choice in ([0, 1], [2, 3], [2, 4], [0, 2, 3], list(range(8)), [4], [7, 1, 3]):
            idx = torch.tensor(choice)[torch.randint(len(choice), (6, length), generator=g)]
            x = pool[idx].to(dtype).contiguous()
            assert torch.equal(torch.ops.planaria.argmax_rows(x), x.argmax(-1)), (length, choice)


def test_packed_linear_is_the_onednn_call():
    """planaria::packed_linear (what a compiled forward calls; engine/compiled.py) gives
    exactly torch.ops.mkldnn._linear_pointwise's result, with and without a bias."""
    from planaria.engine.models import packing

    if not packing._onednn_packing(torch.bfloat16):
        pytest.skip("no oneDNN bf16 weight packing in this torch on this CPU (AVX2-only hosts)")
    cpu_ext.build()
    assert cpu_ext.available(), cpu_ext.status()
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 80, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    for m in (1, 7, 33):
        x = torch.randn(m, 80, generator=g).bfloat16()
        for bias in (b, None):
            ref = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            assert torch.equal(torch.ops.planaria.packed_linear(x, packed, bias), ref)
