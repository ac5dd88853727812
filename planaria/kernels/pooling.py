"""Pooling over the tokens of each sequence (embedding models).

Inputs are padded [B, S, H] hidden states with a [B, S] bool mask of real tokens, as the
encoder produces them; outputs are [B, H]. Torch reference implementations (CPU and GPU).
"""

from __future__ import annotations

import torch


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the real tokens (sentence-transformers' pooling_mode_mean_tokens)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)  # [B, S, 1]
    summed = (hidden * m).sum(dim=1)  # [B, H]
    counts = m.sum(dim=1).clamp(min=1e-9)  # [B, 1]
    return summed / counts


def cls_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return hidden[:, 0]


def max_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    filled = hidden.masked_fill(~mask.unsqueeze(-1), torch.finfo(hidden.dtype).min)
    return filled.max(dim=1).values


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """torch.nn.functional.normalize(p=2), as sentence-transformers' Normalize module."""
    return x / x.norm(dim=-1, keepdim=True).clamp(min=eps)


POOLERS = {"mean": mean_pool, "cls": cls_pool, "max": max_pool}
