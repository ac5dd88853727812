"""Inputs and naive references for the kernel tests, shared by the CPU tests and the GPU
tests (which run the same kernels on cuda and compare with these references).

The references are written the slow, obvious way (one token or one query at a time, in
float64), so they share no code with the kernels they check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# ---- paged attention ----------------------------------------------------------------------


@dataclass
class Seq:
    """One sequence of a mixed batch. ``start`` tokens are already in the cache (an earlier
    step or a prefix-cache hit); this step computes tokens start .. start + q_len - 1."""

    start: int
    q_len: int
    decode: bool
    blocks: list[int]
    shares_prefix_of: int | None = None  # index of a sequence whose first blocks it reuses

    @property
    def ctx_len(self) -> int:
        return self.start + self.q_len


@dataclass
class AttentionCase:
    seqs: list[Seq]
    q_full: list[torch.Tensor]  # per seq [ctx, Hq, D]
    k_full: list[torch.Tensor]  # per seq [ctx, Hkv, D]
    v_full: list[torch.Tensor]
    block_size: int
    num_slots: int
    scale: float


def attention_case(seed: int = 0, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
                   block_size: int = 4, num_blocks: int = 64) -> AttentionCase:
    """Three decodes, a fresh prefill (plain causal path), a chunk after a cached prefix
    (masked path), and a prefill that reuses the fresh prefill's first two blocks in the
    same batch (a prefix-cache hit on blocks written by this very step)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, non-contiguous blocks

    def take(n):
        return [perm.pop() for _ in range(n)]

    # (start, q_len, decode): decodes at context 1, 7 and 13 (a partial last block), then
    # a fresh 9-token prefill and a 5-token chunk after an 8-token cached prefix.
    shapes = [(0, 1, True), (6, 1, True), (12, 1, True), (0, 9, False), (8, 5, False)]
    seqs = [Seq(s, q, d, take(-(-(s + q) // block_size))) for s, q, d in shapes]
    fresh = seqs[3]
    shared = Seq(8, 3, False, fresh.blocks[:2] + take(1), shares_prefix_of=3)  # tokens 0..7 from seq 3
    seqs.append(shared)
    q_full, k_full, v_full = [], [], []
    for s in seqs:
        q_full.append(torch.randn(s.ctx_len, num_heads, head_dim, generator=g))
        k = torch.randn(s.ctx_len, num_kv_heads, head_dim, generator=g)
        v = torch.randn(s.ctx_len, num_kv_heads, head_dim, generator=g)
        if s.shares_prefix_of is not None:
            k[: s.start] = k_full[s.shares_prefix_of][: s.start]
            v[: s.start] = v_full[s.shares_prefix_of][: s.start]
        k_full.append(k)
        v_full.append(v)
    return AttentionCase(seqs, q_full, k_full, v_full, block_size, num_blocks * block_size,
                         head_dim ** -0.5)


def slots_of(seq: Seq, block_size: int, positions) -> list[int]:
    return [seq.blocks[p // block_size] * block_size + p % block_size for p in positions]


def attention_inputs(case: AttentionCase, device, dtype):
    """(q, k, v, k_cache, v_cache, metadata) for one paged_attention call: the batch holds
    decodes first, then prefills (the kernel's layout); the cache holds every sequence's
    tokens before ``start``, except prefixes this same batch writes."""
    from planaria.kernels.attention import build_metadata

    heads_kv, dim = case.k_full[0].shape[1:]
    k_cache = torch.zeros(case.num_slots, heads_kv, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    for s, k, v in zip(case.seqs, case.k_full, case.v_full):
        if s.start and s.shares_prefix_of is None:
            idx = torch.tensor(slots_of(s, case.block_size, range(s.start)))
            k_cache[idx] = k[: s.start].to(dtype)
            v_cache[idx] = v[: s.start].to(dtype)
    order = [s for s in case.seqs if s.decode] + [s for s in case.seqs if not s.decode]
    pick = [case.seqs.index(s) for s in order]
    rows = [slice(case.seqs[i].start, case.seqs[i].ctx_len) for i in pick]
    q = torch.cat([case.q_full[i][r] for i, r in zip(pick, rows)])
    k = torch.cat([case.k_full[i][r] for i, r in zip(pick, rows)])
    v = torch.cat([case.v_full[i][r] for i, r in zip(pick, rows)])
    decodes = [s for s in order if s.decode]
    md = build_metadata([s.blocks for s in decodes], [s.ctx_len for s in decodes],
                        [(s.blocks, s.start, s.q_len) for s in order if not s.decode],
                        case.block_size, torch.device(device))
    to = dict(device=device, dtype=dtype)
    return (q.to(**to), k.to(**to), v.to(**to), k_cache.to(device), v_cache.to(device), md), pick


def attention_reference(case: AttentionCase, pick: list[int]) -> torch.Tensor:
    """Naive causal attention in float64, one query at a time, batch rows in kernel order."""
    rows = []
    for i in pick:
        s, q, k, v = case.seqs[i], case.q_full[i].double(), case.k_full[i].double(), case.v_full[i].double()
        group = q.shape[1] // k.shape[1]
        for p in range(s.start, s.ctx_len):
            heads = []
            for h in range(q.shape[1]):
                kh, vh = k[: p + 1, h // group], v[: p + 1, h // group]  # keys 0..p (causal)
                scores = (kh @ q[p, h]) * case.scale
                heads.append(torch.softmax(scores, dim=0) @ vh)
            rows.append(torch.stack(heads))
    return torch.stack(rows)  # [T, Hq, D]


# ---- MoE ----------------------------------------------------------------------------------


@dataclass
class MoECase:
    x: torch.Tensor  # [T, H]
    router_logits: torch.Tensor  # [T, E]
    w13: torch.Tensor  # [E, 2I, H]
    w2: torch.Tensor  # [E, H, I]
    top_k: int


def moe_case(num_tokens: int, seed: int = 0, hidden: int = 64, inter: int = 32, num_experts: int = 8,
             top_k: int = 2, favour: list[int] | None = None) -> MoECase:
    """Random weights; ``favour`` biases the router so every token picks those experts."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if favour:
        logits[:, favour] += 20.0
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / math.sqrt(hidden)
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / math.sqrt(inter)
    return MoECase(x, logits, w13, w2, top_k)


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool):
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def moe_reference(case: MoECase, weights: torch.Tensor, ids: torch.Tensor,
                  experts: range | None = None) -> torch.Tensor:
    """Per token, per chosen expert: w * down(silu(gate(x)) * up(x)), float64. Only experts
    in ``experts`` contribute (an expert-parallel rank's share)."""
    inter = case.w2.shape[2]
    out = torch.zeros(case.x.shape, dtype=torch.float64)
    for t in range(case.x.shape[0]):
        xt = case.x[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if experts is not None and e not in experts:
                continue
            gate_up = case.w13[e].double() @ xt
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(weights[t, j]) * (case.w2[e].double() @ h)
    return out


# ---- RMSNorm, rotary ----------------------------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return weight.double() * (xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps))


def rope_config(rope_type: str):
    from transformers import LlamaConfig

    params = {
        "default": {"rope_type": "default", "rope_theta": 10000.0},
        "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "llama3": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                 "original_max_position_embeddings": 256},
    }[rope_type]
    return LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       max_position_embeddings=2048, rope_parameters=params)


def rope_frequencies(cfg) -> tuple[torch.Tensor, float]:
    """transformers' own Llama (inv_freq [D/2], attention scaling) for ``cfg``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(cfg)
    return rope.inv_freq, float(rope.attention_scaling)


def rope_reference(cfg, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """transformers' own Llama rotary embedding and apply_rotary_pos_emb, in float32."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    rope = LlamaRotaryEmbedding(cfg)
    cos, sin = rope(q.float().transpose(0, 1)[None], positions[None])  # [1, T, D]
    qh, kh = apply_rotary_pos_emb(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                  cos, sin, unsqueeze_dim=1)
    return qh[0].transpose(0, 1), kh[0].transpose(0, 1)  # [T, H, D]
