"""KV blocks between engines that do not share a KV segment directory (another node): a
handover's pre-copy over the network (issue 29).

On one node a survivor reads a draining engine's blocks from its segment file
(engine/kv_segment.py). An engine on another node finds no such file (utility
``prefetch_kv`` says ``seen: false``); the frontend then relays the blocks itself, in
bounded parts, over the channels it already has to both engines (ZMQ, CurveZMQ where
configured):

- ``export_kv`` on the draining engine: the committed blocks of a request's tokens (its
  prompt and output so far, with its salt), from ``start_block``, at most ``max_bytes`` of
  K/V per reply, with their chained hashes, the engine's weights-and-layout fingerprint and
  its KV layout. Only blocks the segment's record holds as committed are sent (positions a
  forward was still writing never are), read on the engine thread between steps.
- ``import_kv`` on the survivor: everything checked before use (fingerprint, layout and
  dtype equal to its own; the hashes equal to those it computes from the same tokens and
  salt, so a block is only ever cached under the prefix it was computed for; the data's
  length exact), then copied into free blocks and cached, where the request's move finds
  them: only what was committed since (and the last partial block) is computed then.

A part that fails (an engine gone, a refusal, the deadline) ends the transfer; the move
computes what is missing. Only the bulk goes this way: a crash on another node is still a
plain replay (the dead engine's memory is not reachable from here).
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from planaria.engine.block_pool import hash_request_blocks
from planaria.engine.kv_segment import KVLayout

EXPORT_MAX_BYTES = 8 << 20  # K/V per reply by default
EXPORT_LIMIT_BYTES = 64 << 20  # and at most, whatever the caller asks


def check_tokens(core, token_ids: Any, cache_salt: Any) -> None:
    """A request's tokens (and salt) as a caller of prefetch_kv / export_kv / import_kv gave them."""
    from planaria.engine.messages import MAX_CACHE_SALT_CHARS

    if not isinstance(token_ids, list) or len(token_ids) > core.max_model_len or not all(
            type(t) is int and 0 <= t < core.vocab_size for t in token_ids):
        raise ValueError(f"token_ids must be a list of at most {core.max_model_len} token ids")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS):
        raise ValueError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters")


def _segment(core):
    seg = getattr(core.runner, "kv_segment", None)
    if seg is None or not core.kv.enable_caching:
        raise ValueError("this engine keeps no KV segment (--kv-salvage off, or no room on tmpfs)")
    return seg


def _block_bytes(layout: KVLayout) -> int:
    """K and V of one block over every layer."""
    return 2 * layout.num_layers * layout.block_size * layout.num_kv_heads * layout.head_dim * layout.elem_bytes


def export_kv(core, token_ids: list[int], cache_salt: str | None = None, start_block: int = 0,
              max_bytes: int = EXPORT_MAX_BYTES) -> dict:
    """The leading run of committed blocks of ``token_ids`` from block ``start_block`` on:
    {"hashes", "data" (K/V as [layers, 2, blocks, block elements] bytes), "fingerprint",
    "layout", "num_full_blocks" (of the tokens)}; no hashes when there is nothing (more)."""
    check_tokens(core, token_ids, cache_salt)
    if type(start_block) is not int or start_block < 0:
        raise ValueError("start_block must be an integer >= 0")
    if type(max_bytes) is not int or max_bytes <= 0:
        raise ValueError("max_bytes must be a positive integer")
    seg = _segment(core)
    layout = seg.layout
    hashes = hash_request_blocks(token_ids, core.kv.block_size, [], cache_salt)
    limit = max(1, min(max_bytes, EXPORT_LIMIT_BYTES) // _block_bytes(layout))
    ids, run = [], []
    for h in hashes[start_block:start_block + limit]:
        b = core.kv.pool.lookup(h)
        if b is None:
            break
        s = int(seg.seqs[b])
        if s == 0 or s & 1 or int(seg.hashes[b]) != h:  # not (or not yet) written by a finished forward
            break
        ids.append(b)
        run.append(h)
    data = b""
    if ids:
        index = torch.tensor(ids, dtype=torch.long)
        part = seg.blocks.index_select(2, index)  # [layers, 2, n, block elements]
        data = part.contiguous().view(torch.uint8).numpy().tobytes()
    return {"hashes": run, "data": data, "start_block": start_block, "num_full_blocks": len(hashes),
            "fingerprint": core.runner.kv_fingerprint(core.kv_identity), "layout": msgspec.to_builtins(layout)}


def import_kv(core, token_ids: list[int], hashes: list[int], data: bytes, fingerprint: bytes, layout: dict,
              cache_salt: str | None = None, start_block: int = 0) -> dict:
    """Blocks ``export_kv`` sent, into this engine's prefix cache: {"blocks": adopted}.
    Every byte is checked first; anything that does not match raises ValueError."""
    check_tokens(core, token_ids, cache_salt)
    if type(start_block) is not int or start_block < 0:
        raise ValueError("start_block must be an integer >= 0")
    seg = _segment(core)
    if not isinstance(fingerprint, bytes) or fingerprint != core.runner.kv_fingerprint(core.kv_identity):
        raise ValueError("other weights or KV layout (fingerprint differs)")
    try:
        theirs = msgspec.convert(layout, KVLayout)
    except (msgspec.ValidationError, TypeError) as exc:
        raise ValueError(f"bad layout: {exc}") from None
    if not theirs.compatible(seg.layout):
        raise ValueError(f"KV layout {theirs} differs from this engine's {seg.layout}")
    mine = hash_request_blocks(token_ids, core.kv.block_size, [], cache_salt)
    if not isinstance(hashes, list) or not hashes or hashes != mine[start_block:start_block + len(hashes)]:
        raise ValueError("the hashes are not those of these tokens' blocks")
    per_block = _block_bytes(seg.layout)
    if not isinstance(data, bytes) or len(data) != len(hashes) * per_block:
        raise ValueError(f"data must be {len(hashes)} x {per_block} bytes")
    i = 0
    while i < len(hashes) and core.kv.pool.lookup(hashes[i]) is not None:
        i += 1  # cached here already
    if i == len(hashes):
        return {"blocks": 0}
    lay = seg.layout
    src = torch.frombuffer(bytearray(data), dtype=getattr(torch, lay.dtype)).view(
        lay.num_layers, 2, len(hashes), -1)

    def copy(dst: list[int]) -> int:
        n = len(dst)
        seg.blocks.index_copy_(2, torch.tensor(dst, dtype=torch.long), src[:, :, i:i + n])
        return n

    adopted = core.kv.import_blocks(hashes[i:], copy)
    core.salvage.num_blocks += adopted
    return {"blocks": adopted}
