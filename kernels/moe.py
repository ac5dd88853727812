"""Mixture-of-experts routing and grouped expert matmul.

Tokens are sorted by expert and each expert runs one matmul over all of its tokens: the
Python loop is over experts (a few dozen), never over tokens. ``experts_local`` lets an
expert-parallel rank compute only the experts it owns (kernels stay EP-agnostic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    # router_logits: [T, E] -> weights [T, K] (input dtype), ids [T, K] int64
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def grouped_expert_mlp(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E_local, 2I, H]: gate rows then up rows
    w2: torch.Tensor,  # [E_local, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] global expert ids
    expert_offset: int = 0,  # global id of local expert 0
) -> torch.Tensor:
    T, K = topk_ids.shape
    num_local = w13.shape[0]
    flat_ids = topk_ids.reshape(-1) - expert_offset  # [T*K]
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    counts = torch.bincount(sorted_ids.clamp(0, num_local), minlength=num_local + 1).tolist()
    token_of = order // K  # [T*K] token index of each sorted pair
    weight_of = topk_weights.reshape(-1)[order]
    # Pair outputs in sorted order; pairs of experts not held here stay zero.
    pair_out = x.new_zeros(T * K, x.shape[1])  # [T*K, H]
    # Pairs for experts below offset sort first (negative ids); skip them.
    start = int((sorted_ids < 0).sum()) if expert_offset else 0
    inter = w2.shape[2]
    for e in range(num_local):
        n = counts[e] if e else counts[0] - start
        if n <= 0:
            continue
        xe = x.index_select(0, token_of[start:start + n])  # [n, H]
        gate_up = F.linear(xe, w13[e])  # [n, 2I]
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        pair_out[start:start + n] = F.linear(h, w2[e]) * weight_of[start:start + n, None]
        start += n
    # Un-sort and sum each token's K expert outputs (no scatter-add).
    unsorted = torch.empty_like(pair_out)
    unsorted[order] = pair_out
    return unsorted.view(T, K, x.shape[1]).sum(dim=1)
