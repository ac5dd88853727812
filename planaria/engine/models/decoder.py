"""One decoder-only transformer covering the Llama family: Llama, Qwen2 (qkv bias),
Qwen3 (per-head q/k RMSNorm), Qwen3-MoE and Mixtral (sparse MoE MLP).

Inputs are flat: all tokens of the batch in one [T] row, positions [T], and the paged
attention metadata. Projections are fused (qkv, gate/up) at load time.

Parameters are created uninitialised (``Linear``/``Embedding`` below run no init; the
loader builds the model on the meta device) because every one of them is read from the
checkpoint: engine/models/loader.py fills each parameter or fails with the missing name.
The rotary tables are computed, not loaded: the caller builds them on the real device.

``batch_invariant`` (EngineConfig.batch_invariant): every linear, the attention, the MoE
experts and the lm_head take the kernels whose result for a token does not depend on its
batch-mates nor on whether its position was prefilled or decoded (kernels/linear.py,
kernels/attention.py, kernels/moe.py); RMSNorm, rotary, the embedding and the router's
softmax / top-k work row by row as they are. The caller checks the kernels are there
(kernels/linear.py ``invariant_available``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from planaria.kernels.attention import AttentionMetadata, paged_attention
from planaria.kernels.linear import linear, linear_argmax, lm_head_logits
from planaria.kernels.moe import grouped_expert_mlp, route
from planaria.kernels.norm import RMSNorm
from planaria.kernels.rotary import RotaryEmbedding, apply_rotary


class Linear(nn.Module):
    """y = x W^T (+ b), like nn.Linear but with no random init: nn.Linear's init on the
    meta device runs torch's Python reference ops, which import torch._dynamo and sympy
    (~1.3 s of every engine start) for values the checkpoint overwrites anyway."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype | None = None, invariant: bool = False) -> None:
        super().__init__()
        self.invariant = invariant
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        # the weight packed for oneDNN, or for the invariant kernel in the batch-invariant
        # mode (engine/models/packing.py)
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return linear(x, self.weight, self.bias, self.packed, self.invariant)


class Embedding(nn.Module):
    """Token embedding table, uninitialised like ``Linear``."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return F.embedding(ids, self.weight)


@dataclass
class ModelSpec:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    renormalize: bool = True
    sparse_layers: tuple[int, ...] = ()  # layer indices with a MoE MLP

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, invariant: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.invariant = invariant
        self.qkv = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias, dtype=dtype,
                          invariant=self.invariant)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=False, dtype=dtype, invariant=self.invariant)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale = spec.head_dim ** -0.5

    def forward(self, x, rope, k_cache, v_cache, md: AttentionMetadata):
        # rope: (cos, sin) [T, 1, D] for this batch's positions (RotaryEmbedding.tables)
        T = x.shape[0]
        qkv = self.qkv(x)  # [T, q + 2kv]
        v = qkv[:, self.q_size + self.kv_size:].reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:  # q and k side by side: one rotation for both
            qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads,
                                                                        self.head_dim), *rope)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        else:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = paged_attention(q, k, v, k_cache, v_cache, md, self.scale, self.invariant)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.q_size))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, invariant: bool = False) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up = Linear(hidden, 2 * inter, bias=False, dtype=dtype, invariant=invariant)
        self.down = Linear(inter, hidden, bias=False, dtype=dtype, invariant=invariant)

    def forward(self, x):
        gu = self.gate_up(x)
        return self.down(F.silu(gu[:, :self.inter]) * gu[:, self.inter:])


class SparseMoE(nn.Module):
    """Router over all experts; ``w13``/``w2`` hold experts [expert_start, expert_end).
    With expert parallelism (elastic/ep.py) ``ep_forward`` replaces the local compute."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, expert_start: int = 0, expert_end: int | None = None,
                 invariant: bool = False):
        super().__init__()
        end = spec.num_experts if expert_end is None else expert_end
        self.num_experts, self.top_k, self.renormalize = spec.num_experts, spec.top_k, spec.renormalize
        self.expert_start, self.expert_end = expert_start, end
        n_local = end - expert_start
        self.invariant = invariant
        self.router = Linear(spec.hidden_size, spec.num_experts, bias=False, dtype=dtype, invariant=self.invariant)
        self.w13 = nn.Parameter(torch.empty(n_local, 2 * spec.moe_intermediate_size, spec.hidden_size, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n_local, spec.hidden_size, spec.moe_intermediate_size, dtype=dtype),
                               requires_grad=False)
        self.ep_forward = None  # set by the expert-parallel transform
        # oneDNN-packed (w13[e], w2[e]) per local expert, when all experts are here and the
        # weights are bf16 on the CPU (engine/models/packing.py); the expert loop uses them
        self.packed_experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # Every expert of the layer, [E, ...] views of the node's expert cache file
        # (engine/models/loader.py ``attach_node_experts``), where an expert-parallel rank
        # maps it: the node's page cache holds them once for all its ranks, so ranks on one
        # node can share a layer's experts out by load (elastic/shm_group.py). ``node_key``
        # names the file's contents (0: no views); ranks balance only when all keys agree.
        self.node_w13: torch.Tensor | None = None
        self.node_w2: torch.Tensor | None = None
        self.node_key = 0

    def forward(self, x):  # x: [T, H]
        weights, ids = route(self.router(x), self.top_k, self.renormalize)
        if self.ep_forward is not None:
            return self.ep_forward(self, x, weights, ids)
        return grouped_expert_mlp(x, self.w13, self.w2, weights, ids, self.expert_start, self.packed_experts,
                                  self.invariant)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, idx: int, dtype: torch.dtype, expert_range=None,
                 invariant: bool = False) -> None:
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = Attention(spec, dtype, invariant)
        self.post_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if idx in spec.sparse_layers:
            start, end = expert_range or (0, spec.num_experts)
            self.mlp = SparseMoE(spec, dtype, start, end, invariant)
        else:
            self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size, dtype, invariant)

    def forward(self, x, rope, k_cache, v_cache, md):
        x = x + self.attn(self.input_norm(x), rope, k_cache, v_cache, md)
        return x + self.mlp(self.post_norm(x))


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, dtype: torch.dtype,
                 expert_range: tuple[int, int] | None = None, batch_invariant: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.batch_invariant = batch_invariant
        self.embed = Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, dtype, expert_range, batch_invariant)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False,
                                                                    dtype=dtype, invariant=batch_invariant)
        self.rotary = rotary  # cos/sin tables up to max_positions, computed (not loaded)
        self.lm_head_packed: list[torch.Tensor] | None = None  # chunks: engine/models/packing.py

    def forward(self, input_ids, positions, kv_caches, md: AttentionMetadata):
        # input_ids, positions: [T] -> hidden [T, H]
        x = self.embed(input_ids)
        rope = self.rotary.tables(positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, rope, k_cache, v_cache, md)
        return self.norm(x)

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:  # [N, H] -> [N, V]
        """float32 logits, or (float32=False) the lm_head's own dtype: plain greedy rows
        only take their argmax, which needs no float32 copy."""
        return lm_head_logits(hidden, self.lm_head_weight(), self.lm_head_packed, float32, self.batch_invariant)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N] int64
        """argmax of compute_logits(hidden), for plain greedy rows: where it can, the lm_head
        takes each vocab chunk's argmax while the chunk is in cache (kernels/linear.py)."""
        return linear_argmax(hidden, self.lm_head_weight(), self.lm_head_packed, self.batch_invariant)
