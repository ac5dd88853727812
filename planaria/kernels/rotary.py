"""Rotary position embedding (neox / rotate-half layout, as Llama-family checkpoints use).

The caller gives the inverse frequencies and the attention scaling; engine/models/rope.py
computes them from a checkpoint's config (every rope_type it declares).
"""

import torch


class RotaryEmbedding(torch.nn.Module):
    """Precomputes cos/sin for every position up to max_positions from ``inv_freq`` [D/2];
    both tables are multiplied by ``scaling`` (yarn's attention scaling; 1.0 otherwise)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype,
                 scaling: float = 1.0) -> None:
        super().__init__()
        if inv_freq.dim() != 1 or inv_freq.numel() == 0 or not inv_freq.is_floating_point():
            raise ValueError(f"inv_freq must be a non-empty 1-D float tensor, got "
                             f"{inv_freq.dtype} of shape {tuple(inv_freq.shape)}")
        if max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        pos = torch.arange(max_positions, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, D] for ``positions`` [T]: once per forward, shared by every layer."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]
        cos, sin = self.tables(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
