"""Sampling kernels on logits [N, V]: penalties, logit bias, masking, temperature / min_p / top-k /
top-p, the exponential race, logprobs. Pure tensor functions; the request-level sampler
that reads a step's SamplingMetadata and builds Logprobs records is engine/sampler.py.

The exponential race draws q ~ Exp(1) per (row, token) and takes argmax(probs / q), an
exact sample from probs. Seeded rows draw q from a generator seeded with the given seed
alone, so a row's token does not depend on which other rows share the batch; unseeded rows
share one draw from the global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from planaria.kernels import cpu_ext

_NEG_INF = float("-inf")
_EXT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for [N, V], first index on ties, NaN counting as the maximum.

    ATen's CPU argmax is a scalar loop (about 1 ns an element), while ``amax`` is
    vectorized; so on CPU take the vectorized max of blocks of B, the (scalar) argmax of
    the N x V/B block maxima, then the argmax within each winning block: 4-8x faster at
    V = 4k..150k, and the same answer, ties and NaN included. Where the C++ kernels are
    built, kernels/csrc/argmax.cpp does it in one op, reading bfloat16 logits as they are.
    """
    n, v = x.shape
    if (x.device.type == "cpu" and x.is_contiguous() and v and x.dtype in _EXT_DTYPES
            and cpu_ext.available()):
        return torch.ops.planaria.argmax_rows(x)  # kernels/csrc/argmax.cpp: one pass, any of the three dtypes
    block = _argmax_block(v)
    if x.device.type != "cpu" or block == 0 or not x.is_contiguous():
        return x.argmax(dim=-1)
    blocks = x.view(n, v // block, block)  # [N, V/B, B]
    best = blocks.amax(dim=-1).argmax(dim=-1)  # [N], first block holding the max
    within = blocks[torch.arange(n, device=x.device), best].argmax(dim=-1)  # [N]
    return best * block + within


def _argmax_block(vocab_size: int) -> int:
    """Largest power of two in [16, sqrt(V)] dividing V, or 0 (fall back to argmax)."""
    block = 1 << (max(1, int(vocab_size ** 0.5)).bit_length() - 1)
    while block >= 16:
        if vocab_size % block == 0:
            return block
        block >>= 1
    return 0


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, repetition: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, prompt_mask: torch.Tensor,
                    output_token_ids: torch.Tensor) -> torch.Tensor:
    """Out of place, on the P ``rows`` [P] of ``logits`` [N, V]; the other rows are left
    untouched. Repetition: tokens seen in the prompt (``prompt_mask`` [P, V] bool) or the
    output (``output_token_ids`` [P, L], right-padded with V, a dropped bin) have positive
    logits divided and negative ones multiplied by ``repetition`` [P]; ``presence`` and
    ``frequency`` [P] subtract per output token (once, and once per occurrence)."""
    vocab_size = logits.shape[1]
    sub = logits.index_select(0, rows)  # [P, V]
    counts = torch.zeros(sub.shape[0], vocab_size + 1, dtype=sub.dtype, device=sub.device)  # [P, V+1]
    counts.scatter_add_(1, output_token_ids, torch.ones_like(output_token_ids, dtype=sub.dtype))
    counts = counts[:, :vocab_size]  # [P, V], drop the padding bin
    in_output = counts > 0  # [P, V]
    rep = repetition.unsqueeze(1)  # [P, 1]
    seen = prompt_mask | in_output
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * in_output
    return logits.index_copy(0, rows, sub)


def mask_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Out of place: -inf at the (``rows`` [M], ``token_ids`` [M]) pairs of ``logits`` [N, V]."""
    return logits.index_put((rows, token_ids), torch.tensor(_NEG_INF, device=logits.device))


def add_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                   bias: torch.Tensor) -> torch.Tensor:
    """Out of place: ``bias`` [B] added at the (``rows`` [B], ``token_ids`` [B]) pairs of
    ``logits`` [N, V] (pairs may repeat: they add up). A finite bias leaves -inf at -inf."""
    return logits.index_put((rows, token_ids), bias.to(logits.dtype), accumulate=True)


def keep_tokens(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Out of place: on ``rows`` [A] of ``logits`` [N, V], -inf wherever ``allowed`` [A, V]
    (bool) is False; the other rows are left untouched."""
    sub = logits.index_select(0, rows).masked_fill_(~allowed, _NEG_INF)  # [A, V]
    return logits.index_copy(0, rows, sub)


def sample_random(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None = None,
                  top_p: torch.Tensor | None = None, min_p: torch.Tensor | None = None,
                  seeds: Iterable[tuple[int, int]] = ()) -> torch.Tensor:
    """[N, V] -> [N] by ``temperature`` [N], ``min_p`` [N] (0 = off), top-k and top-p (see
    ``apply_top_k_top_p``) and the exponential race. ``seeds``: (row, seed) pairs whose
    race draws from a generator seeded with ``seed``. A row at temperature 1 with every
    filter off samples from softmax(logits)."""
    x = logits / temperature.unsqueeze(1)  # [N, V]
    if min_p is not None:
        probs = x.softmax(dim=-1)
        top = probs.amax(dim=-1, keepdim=True)  # [N, 1]
        x = x.masked_fill(probs < min_p.unsqueeze(1) * top, _NEG_INF)
    x = apply_top_k_top_p(x, top_k, top_p)
    probs = x.softmax(dim=-1)  # [N, V]
    # q ~ Exp(1) as -log(u), u ~ U[0, 1): q > 0, so probs / q is never 0/0 = NaN. (Also
    # several times faster than exponential_ on CPU.)
    u = torch.empty_like(probs).uniform_()  # [N, V]
    for row, seed in seeds:
        gen = torch.Generator(device=probs.device)
        gen.manual_seed(seed)
        u[row].uniform_(generator=gen)
    q = u.log_().neg_()  # [N, V]
    return argmax_rows(probs.div_(q))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf what top-k (per row [N] int64, V = off) and top-p ([N], 1.0 = off)
    exclude. The top token always survives."""
    if top_p is None:
        return logits if top_k is None else _apply_top_k(logits, top_k)
    srt, order = logits.sort(dim=-1, descending=False)  # [N, V] ascending
    if top_k is not None:
        kth = srt.gather(1, (logits.shape[1] - top_k).unsqueeze(1))  # [N, 1]
        srt = srt.masked_fill(srt < kth, _NEG_INF)
    cum = srt.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
    drop = cum <= 1 - top_p.unsqueeze(1)
    drop[:, -1] = False
    srt = srt.masked_fill(drop, _NEG_INF)
    return srt.scatter(1, order, srt)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k without a full sort: the k-th largest value per row from one topk."""
    max_k = int(top_k.max())
    top = logits.topk(max_k, dim=-1).values  # [N, max_k]
    kth = top.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))  # [N, 1]
    kth = kth.masked_fill((top_k >= logits.shape[1]).unsqueeze(1), _NEG_INF)
    return logits.masked_fill(logits < kth, _NEG_INF)


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of R rows: the sampled token's, its rank, and the top-n of each row."""

    token_ids: torch.Tensor  # [R] int64, the sampled tokens
    logprobs: torch.Tensor  # [R], their logprobs
    ranks: torch.Tensor  # [R] int64, 1-based: tokens whose logprob is >= the sampled one's
    top_token_ids: torch.Tensor  # [R, n] int64, most likely first
    top_logprobs: torch.Tensor  # [R, n]


def compute_logprobs(logits: torch.Tensor, sampled: torch.Tensor, rows: torch.Tensor,
                     num_top: int) -> TokenLogprobs:
    """From log_softmax(``logits`` [N, V]) on ``rows`` [R]: the ``sampled`` [N] token's
    logprob and rank, and the ``num_top`` most likely tokens (0 <= num_top <= V)."""
    return token_logprobs(logits.index_select(0, rows), sampled.index_select(0, rows), num_top)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> TokenLogprobs:
    """From log_softmax(``logits`` [R, V]), computed in float32: the logprob and rank of
    ``token_ids`` [R] (one per row) and the ``num_top`` most likely tokens of each row."""
    if not 0 <= num_top <= logits.shape[1]:
        raise ValueError(f"num_top must be in [0, {logits.shape[1]}], got {num_top}")
    lp = logits.float().log_softmax(dim=-1)  # [R, V]
    tok = token_ids.unsqueeze(1)  # [R, 1]
    tok_lp = lp.gather(1, tok)  # [R, 1]
    ranks = (lp >= tok_lp).sum(dim=-1)  # [R]
    if num_top > 0:
        top_lp, top_ids = lp.topk(num_top, dim=-1)  # [R, n]
    else:
        top_lp = lp.new_empty(lp.shape[0], 0)
        top_ids = torch.empty(lp.shape[0], 0, dtype=torch.int64, device=lp.device)
    return TokenLogprobs(tok.squeeze(1), tok_lp.squeeze(1), ranks, top_ids, top_lp)
