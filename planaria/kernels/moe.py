"""Mixture-of-experts routing and grouped expert matmul.

Tokens are sorted by expert and each expert runs one matmul over all of its tokens: the
Python loop is over experts (a few dozen), never over tokens. ``experts_local`` lets an
expert-parallel rank compute only the experts it owns (kernels stay EP-agnostic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from planaria.kernels import cpu_ext
from planaria.kernels.linear import packed_linear


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    # router_logits: [T, E] -> weights [T, K] (input dtype), ids [T, K] int64
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_kernel_takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, num_pairs: int,
                       invariant: bool = False) -> bool:
    """Whether ``num_pairs`` (token, expert) pairs of ``x`` go through the C++ kernel
    (torch.ops.planaria.fused_moe, or fused_moe_pairs on an expert-parallel rank): the one
    rule for both, so a rank computes its peers' pairs the way one engine would.
    ``invariant`` (the engine's batch-invariant mode): at every size, since a token's
    output from the kernel does not depend on the other tokens (each pair's sums are its
    own accumulators along H and I, the pairs summed in k order), while the torch code's
    order changes with the batch (bmm or the per-expert loop, oneDNN's blocking by rows)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (invariant or num_pairs <= _CPP_PAIRS_PER_EXPERT * w13.shape[0])
            and w13.is_contiguous() and w2.is_contiguous() and cpu_ext.available())


def grouped_expert_mlp(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E_local, 2I, H]: gate rows then up rows
    w2: torch.Tensor,  # [E_local, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] global expert ids
    expert_offset: int = 0,  # global id of local expert 0
    packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None,  # oneDNN-packed (w13[e], w2[e])
    invariant: bool = False,  # batch-invariant mode: the C++ kernel at every size (fused_kernel_takes)
) -> torch.Tensor:
    """On the CPU (float32, bfloat16, float16) small batches run the C++ kernel (csrc/fused_moe.cpp,
    built by cpu_ext.py; the torch code below is its reference). Otherwise:
    pairs are grouped by expert into a padded [E, n_max, H] batch and multiplied with
    one batched matmul per projection: on CPU the experts' skinny GEMMs then run side by
    side (one per thread) and stream weights at about twice the rate of a per-expert
    loop. Badly skewed routing (padding would exceed ``_MAX_PAD_FACTOR`` x the pairs)
    falls back to the per-expert loop, which uses ``packed`` weights when given (bf16 on
    the CPU: engine/models/packing.py)."""
    T, K = topk_ids.shape
    H = x.shape[1]
    num_local = w13.shape[0]
    inter = w2.shape[2]
    if fused_kernel_takes(x, w13, w2, T * K, invariant):
        out = torch.empty_like(x)
        torch.ops.planaria.fused_moe(x.contiguous(), w13, w2, topk_weights.float().contiguous(),
                                     topk_ids.contiguous(), expert_offset, out)
        return out
    if T * K <= _FEW_PAIRS:
        out = _few_pairs(x, w13, w2, topk_weights, topk_ids, expert_offset, packed)
        if out is not None:
            return out
    flat_ids = topk_ids.reshape(-1) - expert_offset  # [P = T*K]
    local = (flat_ids >= 0) & (flat_ids < num_local)
    ids = torch.where(local, flat_ids, num_local)  # pairs of other ranks' experts: bucket E
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    counts = torch.bincount(sorted_ids, minlength=num_local + 1)  # [E + 1]
    num_pairs = int(counts[:num_local].sum())
    pair_out = x.new_zeros(T * K, H)  # [P, H] in sorted order
    if num_pairs:
        token_of = (order // K)[:num_pairs]
        weight_of = topk_weights.reshape(-1)[order][:num_pairs]
        local_counts = counts[:num_local].tolist()
        n_max = max(local_counts)
        num_active = sum(1 for c in local_counts if c)
        # The batched matmul reads every local expert's weights, used or not: worth it
        # only when most experts have tokens (decode at batch 1 touches top_k of them).
        if num_active >= _MIN_ACTIVE_FRACTION * num_local and n_max * num_local <= _MAX_PAD_FACTOR * num_pairs + 64:
            starts = torch.cumsum(counts, 0) - counts  # [E + 1]
            e_of = sorted_ids[:num_pairs]
            slot = e_of * n_max + (torch.arange(num_pairs, device=x.device) - starts[e_of])  # [n]
            xp = x.new_zeros(num_local * n_max, H)
            xp.index_copy_(0, slot, x.index_select(0, token_of))
            gate_up = torch.bmm(xp.view(num_local, n_max, H), w13.transpose(1, 2))  # [E, n, 2I]
            h = F.silu(gate_up[..., :inter]).mul_(gate_up[..., inter:])  # one temporary, not two
            y = torch.bmm(h, w2.transpose(1, 2)).view(-1, H)  # [E * n, H]
            torch.mul(y.index_select(0, slot), weight_of[:, None], out=pair_out[:num_pairs])
        else:
            start = 0
            for e, n in enumerate(local_counts):
                if n:
                    xe = x.index_select(0, token_of[start:start + n])  # [n, H]
                    gate_up = F.linear(xe, w13[e]) if packed is None else packed_linear(xe, packed[e][0])
                    h = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
                    down = F.linear(h, w2[e]) if packed is None else packed_linear(h, packed[e][1])
                    pair_out[start:start + n] = down * weight_of[start:start + n, None]
                    start += n
    # Un-sort and sum each token's K expert outputs (no scatter-add).
    unsorted = torch.empty_like(pair_out).index_copy_(0, order, pair_out)
    return unsorted.view(T, K, H).sum(dim=1)


def expert_pair_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                        expert_offset: int, y: torch.Tensor, invariant: bool = False,
                        num_pairs: int | None = None) -> None:
    """y [T, K, H] float32 <- the unweighted output of each pair (t, k) whose expert is local
    (rows of the other pairs are left as they are): what an expert-parallel rank computes
    for its peers, who sum their pairs with ``moe_combine``. The C++ kernel where
    ``fused_kernel_takes`` (``num_pairs``: the pairs it counts, T * K by default), else the
    torch code over the local pairs alone (rounded to x's dtype, then widened)."""
    T, K = topk_ids.shape
    if fused_kernel_takes(x, w13, w2, T * K if num_pairs is None else num_pairs, invariant):
        torch.ops.planaria.fused_moe_pairs(x.contiguous(), w13, w2, topk_ids.contiguous(), expert_offset, y)
        return
    flat = topk_ids.reshape(-1)
    idx = ((flat >= expert_offset) & (flat < expert_offset + w13.shape[0])).nonzero().squeeze(1)
    if idx.numel():
        xl = x.index_select(0, idx // K)
        yl = grouped_expert_mlp(xl, w13, w2, xl.new_ones(idx.numel(), 1), flat.index_select(0, idx)[:, None],
                                expert_offset, None, invariant)
        y.view(T * K, -1).index_copy_(0, idx, yl.float())


def _few_pairs(x, w13, w2, topk_weights, topk_ids, expert_offset, packed):
    """The per-expert loop for a few (token, expert) pairs (decode at small batches),
    grouped in Python from one ``tolist()``: the sort, bincount and index arithmetic of
    the general path cost more than the experts' GEMMs at one token (bench-moe bf16: 308
    -> 150 us per layer). Same rows per expert in the same order and the same final sum
    as the general path's loop, so the same results bit for bit; None when that path
    would take the batched matmul instead (most experts active)."""
    T, K = topk_ids.shape
    num_local, inter = w13.shape[0], w2.shape[2]
    by_expert: dict[int, list[int]] = {}
    for p, e in enumerate(topk_ids.reshape(-1).tolist()):
        e -= expert_offset
        if 0 <= e < num_local:
            by_expert.setdefault(e, []).append(p)
    num_pairs = sum(len(ps) for ps in by_expert.values())
    n_max = max((len(ps) for ps in by_expert.values()), default=0)
    if num_pairs and len(by_expert) >= _MIN_ACTIVE_FRACTION * num_local \
            and n_max * num_local <= _MAX_PAD_FACTOR * num_pairs + 64:
        return None
    pair_out = x.new_zeros(T * K, x.shape[1])
    weights = topk_weights.reshape(-1)
    for e, ps in by_expert.items():
        if len(ps) == 1:
            p = ps[0]
            xe, we = x[p // K:p // K + 1], weights[p:p + 1]
        else:
            idx = torch.tensor(ps, device=x.device)
            xe, we = x.index_select(0, idx // K), weights.index_select(0, idx)
        gate_up = F.linear(xe, w13[e]) if packed is None else packed_linear(xe, packed[e][0])
        h = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
        down = F.linear(h, w2[e]) if packed is None else packed_linear(h, packed[e][1])
        if len(ps) == 1:
            torch.mul(down, we[:, None], out=pair_out[ps[0]:ps[0] + 1])
        else:
            pair_out.index_copy_(0, idx, down * we[:, None])
    return pair_out.view(T, K, x.shape[1]).sum(dim=1)  # T may be 0 (an idle EP rank's dummy step)




_MAX_PAD_FACTOR = 4
# on the CPU with the C++ kernels built: csrc/fused_moe.cpp while an expert has
# at most this many pairs on average (AMD EPYC AVX512-BF16: 5.4x the torch code at 32
# pairs over 16 experts, 2x at 128, 1.25x at 256; 4 experts of SmolLM2's MoE: even at 64)
_CPP_PAIRS_PER_EXPERT = 16
_FEW_PAIRS = 8  # T * top_k at or below which _few_pairs groups the pairs in Python
_MIN_ACTIVE_FRACTION = 0.6  # bmm streams weights ~1.7x faster than the per-expert loop
