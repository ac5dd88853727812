"""Encoder-only BERT (as transformers' BertModel, eval mode, absolute positions).

Inputs are a padded batch: ids [B, S] and a bool mask [B, S] of real tokens; attention is
plain SDPA with the padding mask (no KV cache: every request is one full forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from planaria.engine.errors import UnsupportedModelError


@dataclass(frozen=True)
class BertSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int = 0

    @classmethod
    def from_config(cls, cfg: dict) -> "BertSpec":
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise UnsupportedModelError(f"BERT hidden_act {cfg.get('hidden_act')!r} is not supported (only gelu)")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError("only absolute position embeddings are supported")
        return cls(cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
                   cfg["intermediate_size"], cfg["max_position_embeddings"], cfg.get("type_vocab_size", 2),
                   cfg.get("layer_norm_eps", 1e-12), cfg.get("pad_token_id", 0) or 0)


class BertLayer(nn.Module):
    def __init__(self, s: BertSpec) -> None:
        super().__init__()
        self.num_heads = s.num_heads
        self.qkv = nn.Linear(s.hidden_size, 3 * s.hidden_size)
        self.attn_out = nn.Linear(s.hidden_size, s.hidden_size)
        self.attn_norm = nn.LayerNorm(s.hidden_size, eps=s.layer_norm_eps)
        self.up = nn.Linear(s.hidden_size, s.intermediate_size)
        self.down = nn.Linear(s.intermediate_size, s.hidden_size)
        self.out_norm = nn.LayerNorm(s.hidden_size, eps=s.layer_norm_eps)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape  # [B, S, H]
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, h // self.num_heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, NH, S, D]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # [B, NH, S, D]
        a = a.transpose(1, 2).reshape(b, s, h)
        x = self.attn_norm(x + self.attn_out(a))
        return self.out_norm(x + self.down(F.gelu(self.up(x))))


class BertEncoder(nn.Module):
    def __init__(self, s: BertSpec) -> None:
        super().__init__()
        self.spec = s
        self.word = nn.Embedding(s.vocab_size, s.hidden_size)
        self.position = nn.Embedding(s.max_position_embeddings, s.hidden_size)
        self.token_type = nn.Embedding(s.type_vocab_size, s.hidden_size)
        self.embed_norm = nn.LayerNorm(s.hidden_size, eps=s.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(s) for _ in range(s.num_layers))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids [B, S] int64, mask [B, S] bool -> hidden [B, S, H]."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.word(ids) + self.position(pos)[None] + self.token_type.weight[0]
        x = self.embed_norm(x)
        attn_mask = mask[:, None, None, :]  # [B, 1, 1, S]: keys that are real tokens
        for layer in self.layers:
            x = layer(x, attn_mask)
        return x


def hf_state_dict(read, s: BertSpec) -> dict[str, torch.Tensor]:
    """Our parameter names from a BertModel checkpoint; ``read(name)`` returns a tensor
    (names with or without the ``bert.`` prefix are handled by the caller)."""
    out = {
        "word.weight": read("embeddings.word_embeddings.weight"),
        "position.weight": read("embeddings.position_embeddings.weight"),
        "token_type.weight": read("embeddings.token_type_embeddings.weight"),
        "embed_norm.weight": read("embeddings.LayerNorm.weight"),
        "embed_norm.bias": read("embeddings.LayerNorm.bias"),
    }
    for i in range(s.num_layers):
        p, o = f"encoder.layer.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            out[o + f"qkv.{kind}"] = torch.cat(
                [read(p + f"attention.self.{n}.{kind}") for n in ("query", "key", "value")])
            out[o + f"attn_out.{kind}"] = read(p + f"attention.output.dense.{kind}")
            out[o + f"attn_norm.{kind}"] = read(p + f"attention.output.LayerNorm.{kind}")
            out[o + f"up.{kind}"] = read(p + f"intermediate.dense.{kind}")
            out[o + f"down.{kind}"] = read(p + f"output.dense.{kind}")
            out[o + f"out_norm.{kind}"] = read(p + f"output.LayerNorm.{kind}")
    return out
