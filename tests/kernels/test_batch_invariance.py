"""The batch-invariant kernels (``invariant=True``: the engine's batch_invariant mode): a
row's result is the same bits whatever its batch-mates, however many, wherever the row
sits, whatever the thread count; attention's output for a position is the same whether it
was decoded or prefilled, in any chunks. Each checked with torch.equal against the row
computed alone, and against float64 for the arithmetic itself."""

import pytest
import torch

from planaria.kernels import cpu_ext
from planaria.kernels.attention import build_metadata, paged_attention
from planaria.kernels.linear import (invariant_linear, invariant_packs, linear_argmax, lm_head_logits,
                                     pack_invariant)
from planaria.kernels.moe import grouped_expert_mlp, route

CPU = torch.device("cpu")
ROWS = [1, 2, 3, 5, 6, 7, 8, 9, 13, 16, 31, 32, 33, 64, 97, 128, 300]


@pytest.fixture(scope="module", autouse=True)
def built():
    cpu_ext.build()
    assert cpu_ext.available(), cpu_ext.status()


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that changes it."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _rows_alone(fn, x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([fn(x[i:i + 1]) for i in range(n)])


def _check_rows(fn, x: torch.Tensor) -> None:
    """fn's rows for x[:m] equal fn on each row alone, for every m in ROWS, and for the
    rows reversed (each row at another place in the batch)."""
    alone = _rows_alone(fn, x, 128)
    for m in ROWS:
        out = fn(x[:m])
        n = min(m, 128)
        assert torch.equal(out[:n], alone[:n]), f"{m} rows: rows {(out[:n] != alone[:n]).any(1).nonzero().tolist()}"
    rev = fn(x[:64].flip(0)).flip(0)
    assert torch.equal(rev, alone[:64])


bf16_packed = pytest.mark.skipif(not invariant_packs(CPU, torch.bfloat16), reason="needs AVX512-BF16")


@bf16_packed
@pytest.mark.parametrize("N, K, with_bias", [(960, 576, False), (576, 1536, True), (37, 33, True),
                                             (100, 2100, False), (16, 8, False)])
def test_packed_bf16_linear_rows_do_not_depend_on_the_batch(N, K, with_bias, threads):
    # odd K (a half pair), N not a multiple of 16 (masked stores), K past one pass
    # (2100 > 2 x 512 pairs: partial sums carried in float32)
    g = torch.Generator().manual_seed(N + K)
    w = torch.randn(N, K, generator=g).bfloat16()
    bias = torch.randn(N, generator=g).bfloat16() if with_bias else None
    x = torch.randn(300, K, generator=g).bfloat16()
    packed = pack_invariant(w)

    def fn(rows):
        return invariant_linear(rows, w, bias, packed)
    _check_rows(fn, x)
    ref = x[:64].double() @ w.double().T + (bias.double() if with_bias else 0)
    out = fn(x[:64])
    assert out.dtype == torch.bfloat16 and out.shape == (64, N)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=2e-2 * ref.abs().max().item())
    many = fn(x[:97])
    torch.set_num_threads(1)  # each output is one thread's; the split of the work changes nothing
    assert torch.equal(fn(x[:97]), many)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unpacked_linear_rows_do_not_depend_on_the_batch(dtype):
    # no packed copy (float32, float16, a CPU without AVX512-BF16): the skinny kernel,
    # INVARIANT_ROWS rows per call
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 96, generator=g).to(dtype)
    bias = torch.randn(200, generator=g).to(dtype)
    x = torch.randn(300, 96, generator=g).to(dtype)
    _check_rows(lambda rows: invariant_linear(rows, w, bias), x)
    ref = x.double() @ w.double().T + bias.double()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(invariant_linear(x, w, bias).double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lm_head_logits_and_greedy_tokens_do_not_depend_on_the_batch(dtype):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(5000, 64, generator=g).to(dtype)
    packed = [pack_invariant(w)] if invariant_packs(CPU, dtype) else None
    x = torch.randn(300, 64, generator=g).to(dtype)
    _check_rows(lambda rows: lm_head_logits(rows, w, packed, float32=True, invariant=True), x)
    logits = lm_head_logits(x, w, packed, float32=True, invariant=True)
    assert logits.dtype == torch.float32
    assert torch.equal(linear_argmax(x, w, packed, invariant=True), logits.argmax(-1))
    _check_rows(lambda rows: linear_argmax(rows, w, packed, invariant=True)[:, None], x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_token_output_does_not_depend_on_the_batch(dtype):
    # up to 2048 tokens: far past the pairs at which the default routing leaves the C++
    # kernel for the torch code; in invariant mode every size takes the kernel
    g = torch.Generator().manual_seed(3)
    E, H, inter = 8, 64, 48
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=g) / inter ** 0.5).to(dtype)
    x = torch.randn(2048, H, generator=g).to(dtype)
    weights, ids = route(torch.randn(2048, E, generator=g).to(dtype), 2, True)

    def fn(n, rows=None):
        idx = torch.arange(n) if rows is None else rows
        return grouped_expert_mlp(x[idx], w13, w2, weights[idx], ids[idx], invariant=True)
    alone = torch.cat([fn(1, torch.tensor([i])) for i in range(64)])
    for n in [2, 7, 33, 64, 300, 2048]:
        assert torch.equal(fn(n)[:64], alone[:n]), n
    assert torch.equal(fn(64, torch.arange(64).flip(0)).flip(0), alone)
    ref = grouped_expert_mlp(x, w13, w2, weights, ids)  # the default routing: the torch code at this size
    torch.testing.assert_close(fn(2048).float(), ref.float(), rtol=5e-2, atol=5e-2)


# -- attention: a position's output, decoded or prefilled in any chunks ---------------------

class _Seqs:
    """Sequences with fixed per-position q/k/v in scattered blocks of one paged cache."""

    def __init__(self, lens: list[int], dtype: torch.dtype, block_size: int = 4, Hq: int = 8, Hkv: int = 2,
                 D: int = 64) -> None:
        g = torch.Generator().manual_seed(4)
        self.block_size = block_size
        nbs = [-(-n // block_size) for n in lens]
        ids = torch.randperm(sum(nbs) + 4, generator=g).tolist()
        self.tables, at = [], 0
        for nb in nbs:
            self.tables.append(ids[at:at + nb])
            at += nb
        slots = (sum(nbs) + 4) * block_size
        self.k_cache = torch.zeros(slots, Hkv, D, dtype=dtype)
        self.v_cache = torch.zeros(slots, Hkv, D, dtype=dtype)
        self.q = [torch.randn(n, Hq, D, generator=g).to(dtype) for n in lens]
        self.k = [torch.randn(n, Hkv, D, generator=g).to(dtype) for n in lens]
        self.v = [torch.randn(n, Hkv, D, generator=g).to(dtype) for n in lens]

    def step(self, decodes: list[tuple[int, int]], prefills: list[tuple[int, int, int]],
             invariant: bool = True) -> dict[tuple[int, int], torch.Tensor]:
        """decodes: (seq, position); prefills: (seq, start, q_len). Writes their K/V and
        returns each (seq, position)'s attention output [Hq, D]."""
        rows = [(s, p) for s, p in decodes] + [(s, st + i) for s, st, n in prefills for i in range(n)]
        md = build_metadata([self.tables[s] for s, _ in decodes], [p + 1 for _, p in decodes],
                            [(self.tables[s], st, n) for s, st, n in prefills], self.block_size, CPU)
        q = torch.stack([self.q[s][p] for s, p in rows])
        k = torch.stack([self.k[s][p] for s, p in rows])
        v = torch.stack([self.v[s][p] for s, p in rows])
        out = paged_attention(q, k, v, self.k_cache, self.v_cache, md, 0.125, invariant)
        return {r: out[i] for i, r in enumerate(rows)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_decode_and_prefill_chunks_agree_bit_for_bit(dtype):
    L = 45
    seqs = _Seqs([L, 30, 17, 60], dtype)
    # A: the whole prompt in one chunk, alone
    a = seqs.step([], [(0, 0, L)])
    # B: chunks of 13, 17, 15, beside other sequences' prefills and decodes
    b = seqs.step([], [(1, 0, 20), (0, 0, 13)])
    b |= seqs.step([(1, 20)], [(0, 13, 17), (2, 0, 17)])
    b |= seqs.step([(1, 21), (2, 16)], [(3, 0, 60), (0, 30, 15)])
    # C: 20 prefilled, then one decode step per position, in batches of other decodes
    c = seqs.step([(3, 59)], [(0, 0, 20)])
    for p in range(20, L):
        c |= seqs.step([(1, 22 + p % 8), (0, p), (3, 59)], [(2, 0, 3 + p % 5)])
    for p in range(L):
        assert torch.equal(a[(0, p)], b[(0, p)]), p
        assert torch.equal(a[(0, p)], c[(0, p)]), p
    # and it is attention: causal softmax over the prefix, in float64
    q, k, v = seqs.q[0].double(), seqs.k[0].double(), seqs.v[0].double()
    G = q.shape[1] // k.shape[1]
    for p in (0, 7, L - 1):
        kk, vv = k[:p + 1].repeat_interleave(G, 1), v[:p + 1].repeat_interleave(G, 1)  # [p + 1, Hq, D]
        probs = torch.softmax(torch.einsum("hd,thd->ht", q[p], kk) * 0.125, -1)
        ref = torch.einsum("ht,thd->hd", probs, vv)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(a[(0, p)].double(), ref, rtol=tol, atol=tol)


def test_attention_prefix_hit_agrees_with_the_full_prefill():
    seqs = _Seqs([40, 40], torch.bfloat16)
    full = seqs.step([], [(0, 0, 40)])
    # sequence 1 shares sequence 0's blocks (a prefix-cache hit of 32 tokens) and
    # prefills the rest from position 32
    seqs.tables[1] = seqs.tables[0][:8] + seqs.tables[1][8:]
    seqs.q[1], seqs.k[1], seqs.v[1] = seqs.q[0], seqs.k[0], seqs.v[0]
    hit = seqs.step([], [(1, 32, 8)])
    for p in range(32, 40):
        assert torch.equal(full[(0, p)], hit[(1, p)]), p


def test_the_default_attention_differs_between_prefill_and_decode():
    # why the invariant mode exists: SDPA's prefill and the decode kernel round differently
    seqs = _Seqs([64], torch.bfloat16)
    pre = seqs.step([], [(0, 0, 64)], invariant=False)
    dec = {}
    for p in range(64):
        dec |= seqs.step([(0, p)], [], invariant=False)
    assert any(not torch.equal(pre[(0, p)], dec[(0, p)]) for p in range(64))
