"""Paged attention over a flat slot cache, prefill and decode mixed in one batch.

Cache layout per layer: ``k_cache``/``v_cache`` of shape [num_blocks * block_size, Hkv, D];
a token's slot is ``block_id * block_size + offset``. Every step first writes the batch's
new K/V into its slots, then attends from the cache, so a request whose prefix was a
prefix-cache hit (possibly computed earlier in this same batch) reads the same values.

Batch order: decode sequences (one query token each) first, then prefill chunks.

Decode on the CPU reads the paged cache in place with the C++ kernel of
kernels/csrc/decode_attention.cpp where it is built (kernels/cpu_ext.py; 5x faster than
the torch code below at one sequence, 1.4-2x at 16-64), in float32 too (the float32
parity tests against transformers still agree token for token). Without it, bf16/fp16
decode does not go through ``scaled_dot_product_attention``: its CPU flash kernel, with
one query row, a mask and GQA, ran 6-15x slower than two batched matmuls (measured on an
AMD EPYC with AVX512-BF16: 6.2 ms against 0.4 ms per layer at 64 sequences of 192 tokens,
SmolLM2's 9 query and 3 KV heads), half the step's time. ``_decode_gqa`` computes the
scores per KV head for its group of query heads (no repeated K/V), softmax in float32,
then the weighted sum. float32 without the kernels, and GPUs, keep SDPA.

Batch invariance (``invariant=True``, the engine's ``batch_invariant`` mode): a query at
position p must get the same output bits whether it was decoded or prefilled (in any
chunk, after a prefix-cache hit or not) and whatever its batch-mates. SDPA's prefill
arithmetic is not the decode kernel's, so in that mode every query row, prefill rows too,
goes through the C++ decode kernel, each with its own context length (the tokens up to
and including itself; the chunk's K/V are in the cache before attention runs). That
kernel's arithmetic for one (query, KV head) depends on the context length alone: it
never splits the KV range (not by batch size, not by thread count), the scores of keys
t and t + 16 k are summed in the same lanes, and the softmax and the weighted sum run
over the context in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from planaria.kernels import cpu_ext


@dataclass
class PrefillSeq:
    q_start: int  # first row of this sequence's queries in the batch
    q_len: int
    ctx_len: int  # tokens attended to (cached prefix + this chunk)
    slots: torch.Tensor  # [ctx_len] int64 cache slots of tokens 0..ctx_len-1
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, None when a plain causal mask fits


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes
    num_decode: int = 0  # first num_decode rows are decodes
    decode_blocks: torch.Tensor | None = None  # [B, NB] int64 block tables (0-padded)
    decode_bias: torch.Tensor | None = None  # decode_mask as float32 0 / -inf, made by the first layer
    decode_ctx_lens: torch.Tensor | None = None  # [B] int64 tokens each decode attends to
    prefills: list[PrefillSeq] = field(default_factory=list)
    block_size: int = 0
    _decode_mask: torch.Tensor | None = None
    _per_query: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def decode_mask(self) -> torch.Tensor | None:
        """[B, 1, 1, NB * block_size] bool (True = attend), made on first use: the C++
        decode kernel reads the lengths instead, so its steps never build it."""
        if self._decode_mask is None and self.num_decode:
            span = self.decode_blocks.shape[1] * self.block_size
            ctx = self.decode_ctx_lens
            self._decode_mask = (torch.arange(span, device=ctx.device)[None, :] < ctx[:, None]).view(
                self.num_decode, 1, 1, span)
        return self._decode_mask

    def per_query_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables [T, NB] int64 (0-padded) and context lengths [T] int64 for every
        query row, decodes then each prefill chunk's rows (query p of a chunk starting at
        s attends to s + p + 1 tokens), made on first use: the invariant mode's one call
        of the decode kernel for the whole batch."""
        if self._per_query is None:
            tables: list[torch.Tensor] = []
            lens: list[torch.Tensor] = []
            if self.num_decode:
                tables.append(self.decode_blocks)
                lens.append(self.decode_ctx_lens)
            for p in self.prefills:
                table = p.slots[::self.block_size] // self.block_size  # [ceil(ctx / block_size)]
                tables.append(table.expand(p.q_len, -1))
                lens.append(torch.arange(p.ctx_len - p.q_len + 1, p.ctx_len + 1, device=table.device))
            width = max(t.shape[1] for t in tables)
            self._per_query = (torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables]).contiguous(),
                               torch.cat(lens))
        return self._per_query


_CPU = torch.device("cpu")


def long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor from a list of ints: through numpy, 2-3x cheaper than torch.tensor."""
    return torch.from_numpy(np.array(values, dtype=np.int64)).to(device)


def build_metadata(
    decode_block_tables: list[list[int]] | np.ndarray,  # an array: [B, >= most blocks], 0-padded
    decode_ctx_lens: list[int],
    prefills: list[tuple[list[int], int, int]],  # (block_ids, start_pos, q_len)
    block_size: int,
    device: torch.device,
    decode_slots: list[int] | None = None,  # each decode token's own slot, if the caller has them
) -> AttentionMetadata:
    slot_parts: list[torch.Tensor] = []
    md = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), block_size=block_size)
    num_decode = len(decode_ctx_lens)
    md.num_decode = num_decode
    if num_decode:
        max_ctx = max(decode_ctx_lens)
        max_blocks = -(-max_ctx // block_size)
        if isinstance(decode_block_tables, np.ndarray):  # KVCacheManager.decode_table's
            table = decode_block_tables[:, :max_blocks]
        else:  # [B, NB], 0-padded (numpy reads nested lists 2.5x faster than torch.tensor)
            table = np.array([bt[:max_blocks] + [0] * (max_blocks - min(len(bt), max_blocks))
                              for bt in decode_block_tables], dtype=np.int64)
        md.decode_blocks = torch.from_numpy(np.ascontiguousarray(table)).to(device)
        md.decode_ctx_lens = long_tensor(decode_ctx_lens, device)
        # each decode token's own slot: the last of its context (plain ints: cheaper than
        # five small tensor ops at 64 sequences)
        if decode_slots is None:
            decode_slots = [bt[(c - 1) // block_size] * block_size + (c - 1) % block_size
                            for bt, c in zip(decode_block_tables, decode_ctx_lens)]
        slot_parts.append(long_tensor(decode_slots, _CPU))
    q_start = num_decode
    for block_ids, start, q_len in prefills:
        ctx_len = start + q_len
        table = torch.tensor(block_ids[: -(-ctx_len // block_size)], dtype=torch.long)
        slots = (table[:, None] * block_size + torch.arange(block_size)).view(-1)[:ctx_len]
        mask = None
        if start:
            q_pos = torch.arange(start, ctx_len)[:, None]
            mask = (torch.arange(ctx_len)[None, :] <= q_pos).to(device)  # [q_len, ctx_len]
        md.prefills.append(PrefillSeq(q_start, q_len, ctx_len, slots.to(device), mask))
        slot_parts.append(slots[start:])
        q_start += q_len
    if len(slot_parts) == 1:
        md.slot_mapping = slot_parts[0].to(device)
    elif slot_parts:
        md.slot_mapping = torch.cat(slot_parts).to(device)
    return md


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [S, Hkv, D]
    v_cache: torch.Tensor,  # [S, Hkv, D]
    md: AttentionMetadata,
    scale: float,
    invariant: bool = False,  # every query through the decode kernel (the module docstring)
) -> torch.Tensor:  # [T, Hq, D]
    k_cache.index_copy_(0, md.slot_mapping, k)
    v_cache.index_copy_(0, md.slot_mapping, v)
    out = torch.empty_like(q)
    if invariant:
        if q.shape[0]:
            blocks, lens = md.per_query_tables()
            torch.ops.planaria.decode_attention(q.contiguous(), k_cache, v_cache, blocks, lens, md.block_size,
                                                scale, out)
        return out
    # decode-only: the batch's own size (a compiled forward keeps it symbolic, while an
    # int attribute would be a constant of the graph: engine/compiled.py)
    B = q.shape[0] if not md.prefills else md.num_decode
    if B and q.device.type == "cpu" and cpu_ext.available():
        # in place from the paged cache (kernels/csrc/decode_attention.cpp): no gather
        torch.ops.planaria.decode_attention(q[:B].contiguous(), k_cache, v_cache, md.decode_blocks,
                                            md.decode_ctx_lens, md.block_size, scale, out[:B])
    elif B:
        # Gather whole blocks (one contiguous row of block_size * Hkv * D each), with
        # index_select rather than advanced indexing: several times faster on CPU than
        # gathering slot by slot. Slots past a sequence's length are masked out.
        NB = md.decode_blocks.shape[1]
        block_size = md.block_size
        blocks = md.decode_blocks.reshape(-1)
        kv_shape = (B, NB * block_size, *k_cache.shape[1:])
        kd = k_cache.view(-1, block_size * k_cache[0].numel()).index_select(0, blocks).view(kv_shape).transpose(1, 2)
        vd = v_cache.view(-1, block_size * v_cache[0].numel()).index_select(0, blocks).view(kv_shape).transpose(1, 2)
        # kd, vd: [B, Hkv, NB * block_size, D]
        if q.device.type == "cpu" and q.dtype != torch.float32:
            # one copy into [B, Hkv, S, D] each: matmul would otherwise copy the strided
            # views itself, K twice over (2x slower at 16-64 sequences on this path)
            out[:B] = _decode_gqa(q[:B], kd.contiguous(), vd.contiguous(), md, scale)
        else:
            qd = q[:B].unsqueeze(2)  # [B, Hq, 1, D]
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=md.decode_mask, scale=scale,
                                                enable_gqa=True)  # [B, Hq, 1, D]
            out[:B] = od.squeeze(2)
    for p in md.prefills:
        qs = q[p.q_start:p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        if p.mask is None:  # whole context is this chunk: plain causal
            ks = k[p.q_start:p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
            vs = v[p.q_start:p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ks = k_cache.index_select(0, p.slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
            vs = v_cache.index_select(0, p.slots).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, scale=scale, enable_gqa=True)
        out[p.q_start:p.q_start + p.q_len] = o.squeeze(0).transpose(0, 1)
    return out


def _decode_gqa(q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, md: AttentionMetadata,
                scale: float) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D], kd/vd [B, Hkv, S, D] (strided views of
    the gathered blocks) -> [B, Hq, D]. Query head h reads KV head h // (Hq / Hkv)."""
    B, Hq, D = q.shape
    Hkv = kd.shape[1]
    if md.decode_bias is None:
        md.decode_bias = torch.zeros(md.decode_mask.shape, dtype=torch.float32,
                                     device=q.device).masked_fill_(~md.decode_mask, float("-inf"))
    scores = torch.matmul(q.view(B, Hkv, Hq // Hkv, D), kd.transpose(-1, -2)).float()  # [B, Hkv, G, S]
    scores.mul_(scale).add_(md.decode_bias)  # bias [B, 1, 1, S]
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, vd).view(B, Hq, D)
