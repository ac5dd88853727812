"""KV that outlives its engine (engine/kv_segment.py): real EngineCores on the tiny-moe demo
model, in the host's default dtype (bf16 with the batch-invariant kernels where the CPU has
AVX512-BF16), each with its KV cache in a segment file on tmpfs. An engine "dies" mid-stream
(it is dropped: its segment stays as a SIGKILL leaves it) and a second engine continues the
request from prompt + emitted tokens naming the dead one's segment: it adopts the committed
blocks, computes only the rest, and produces the same tokens as the uninterrupted run. A
segment it cannot trust (record torn mid-write, other weights, other layout, a hostile name,
a vanished file) is refused and the request is computed as a plain replay, still exact."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from planaria.engine import kv_segment
from planaria.engine.config import EngineConfig
from planaria.engine.core import EngineCore
from planaria.engine.messages import EngineCoreRequest
from planaria.engine.sampling_params import SamplingParams

PROMPT = [100 + (7 * i) % 300 for i in range(50)]
TOTAL = 60  # tokens of the uninterrupted run
CUT = 20  # tokens the first engine produced before it died


@pytest.fixture
def seg_dir(monkeypatch):
    d = Path("/dev/shm") / f"planaria-test-{uuid.uuid4().hex[:12]}"
    d.mkdir(mode=0o700)
    monkeypatch.setenv(kv_segment.SEGMENT_DIR_ENV, str(d))
    monkeypatch.setenv("PLANARIA_CPU_DTYPE", "")  # the host's default dtype, not the suite's float32
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _core(model: str, engine_id: int, monkeypatch, **kw) -> EngineCore:
    monkeypatch.setenv("PLANARIA_ENGINE_ID", str(engine_id))
    cfg = dict(model=model, kv_cache_bytes=4 * 2**20, max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=256, num_threads=1)
    cfg.update(kw)
    return EngineCore(EngineConfig(**cfg))


def _req(rid: str, prompt: list[int], max_tokens: int, **kw) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt),
                             sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                             **kw)


def _run(core: EngineCore, rid: str, limit: int | None = None) -> list[int]:
    """Step until ``rid`` finished (or produced ``limit`` tokens); its tokens."""
    tokens: list[int] = []
    for _ in range(1000):
        outs, _ = core.step()
        for o in outs:
            if o.request_id == rid:
                assert o.error is None, o.error
                tokens += o.new_token_ids
                if o.finish_reason is not None:
                    return tokens
        if limit is not None and len(tokens) >= limit:
            return tokens
    raise AssertionError("the request did not finish")


def _exact(core: EngineCore) -> bool:
    """Whether re-batched tokens are promised bit for bit here (float32, or the invariant kernels)."""
    return core.runner.invariance.on or str(core.runner.dtype) == "torch.float32"


@pytest.fixture(scope="module")
def reference(tiny_moe):
    """The uninterrupted run, in the default dtype, with private KV (no segment dir)."""
    env = {k: os.environ.pop(k) for k in (kv_segment.SEGMENT_DIR_ENV,) if k in os.environ}
    old = os.environ.get("PLANARIA_CPU_DTYPE")
    os.environ["PLANARIA_CPU_DTYPE"] = ""
    try:
        core = EngineCore(EngineConfig(model=tiny_moe, kv_cache_bytes=4 * 2**20, max_model_len=256,
                                       max_num_seqs=8, max_num_batched_tokens=256, num_threads=1))
        assert core.runner.kv_segment is None
        core.add_request(_req("ref", PROMPT, TOTAL))
        return _run(core, "ref")
    finally:
        os.environ.update(env)
        if old is None:
            os.environ.pop("PLANARIA_CPU_DTYPE", None)
        else:
            os.environ["PLANARIA_CPU_DTYPE"] = old


def _die_after(model, monkeypatch, engine_id: int = 1) -> tuple[EngineCore, list[int]]:
    a = _core(model, engine_id, monkeypatch)
    assert a.runner.kv_segment is not None and a.runner.kv_segment.path.exists()
    a.add_request(_req("r", PROMPT, TOTAL))
    return a, _run(a, "r", limit=CUT)


def _replay(b: EngineCore, emitted: list[int], kv_salvage: str | None) -> list[int]:
    b.add_request(_req("r~r1", PROMPT + emitted, TOTAL - len(emitted), num_prior_output_tokens=len(emitted),
                       kv_salvage=kv_salvage))
    return _run(b, "r~r1")


def test_survivor_adopts_committed_blocks_and_continues_token_for_token(tiny_moe, seg_dir, reference, monkeypatch):
    a, emitted = _die_after(tiny_moe, monkeypatch)
    assert emitted == reference[:CUT]
    b = _core(tiny_moe, 2, monkeypatch)
    prefill_before = b.scheduler.num_prefill_tokens
    rest = _replay(b, emitted, a.runner.kv_segment.name)
    bs = b.kv.block_size
    context = len(PROMPT) + CUT
    # a committed every full block its finished forwards wrote, and the positions written so
    # far of the last one: < context - 1 (the last emitted token was sampled, its KV not
    # written yet). The survivor adopts all of them and computes that one token.
    assert (context - 1) % bs, "the test wants a partial last block"
    assert b.salvage.num_blocks == (context - 1) // bs + 1 and b.salvage.num_refused == 0
    assert b.scheduler.num_prefill_tokens - prefill_before == 1
    if _exact(b):
        assert emitted + rest == reference
    assert len(rest) == TOTAL - CUT
    assert not b.kv._tails


def test_a_lost_last_output_still_adopts_the_partial_block(tiny_moe, seg_dir, reference, monkeypatch):
    """The engine died after its step committed but before that step's token reached the
    frontend: the replay has one token fewer than the segment's record covers; the partial
    block is adopted and its last position computed again."""
    a, emitted = _die_after(tiny_moe, monkeypatch)
    b = _core(tiny_moe, 2, monkeypatch)
    prefill_before = b.scheduler.num_prefill_tokens
    rest = _replay(b, emitted[:-1], a.runner.kv_segment.name)
    context = len(PROMPT) + CUT - 1
    assert b.salvage.num_blocks == (context - 1) // b.kv.block_size + 1
    assert b.scheduler.num_prefill_tokens - prefill_before == 1
    if _exact(b):
        assert emitted[:-1] + rest == reference


@pytest.mark.parametrize("damage", ["mid-forward", "mid-record"])
def test_a_partial_block_is_trusted_only_for_its_committed_positions(tiny_moe, seg_dir, reference, monkeypatch,
                                                                     damage):
    """mid-forward: the next forward had written garbage after the committed positions (a
    SIGKILL while it ran): adopted, those positions computed. mid-record: its entry's seq is
    odd (the commit was being written): not adopted, the block's positions computed."""
    a, emitted = _die_after(tiny_moe, monkeypatch)
    seg = a.runner.kv_segment
    bs = a.kv.block_size
    context = len(PROMPT) + CUT
    full = (context - 1) // bs
    tail_block = a.kv.get_block_ids("r")[full]
    if damage == "mid-forward":
        start = tail_block * bs + (context - 1 - full * bs)  # the first position not committed
        seg.kv[:, :, start:tail_block * bs + bs] = 1e4
    else:
        seg.invalidate([tail_block])
    b = _core(tiny_moe, 2, monkeypatch)
    prefill_before = b.scheduler.num_prefill_tokens
    rest = _replay(b, emitted, seg.name)
    partial = damage == "mid-forward"
    assert b.salvage.num_blocks == full + partial
    assert b.scheduler.num_prefill_tokens - prefill_before == (1 if partial else context - full * bs)
    if _exact(b):
        assert emitted + rest == reference


def test_uncommitted_blocks_are_never_adopted(tiny_moe, seg_dir, reference, monkeypatch):
    """A crash while a forward wrote block k (or while its record entry was being written)
    leaves its seq odd: the survivor adopts the blocks before it and computes from there."""
    a, emitted = _die_after(tiny_moe, monkeypatch)
    seg = a.runner.kv_segment
    blocks = a.kv.get_block_ids("r")
    seg.invalidate([blocks[2]])  # as at allocation, before a forward writes it
    b = _core(tiny_moe, 2, monkeypatch)
    rest = _replay(b, emitted, seg.name)
    assert b.salvage.num_blocks == 2
    if _exact(b):
        assert emitted + rest == reference


@pytest.mark.parametrize("damage", ["fingerprint", "magic", "header", "gone", "name", "traversal", "own"])
def test_an_untrusted_segment_is_refused_and_the_request_recomputed(tiny_moe, seg_dir, reference, monkeypatch,
                                                                    damage):
    a, emitted = _die_after(tiny_moe, monkeypatch)
    seg = a.runner.kv_segment
    name = seg.name
    mm = seg._mm
    if damage == "fingerprint":  # other weights
        mm[kv_segment.FINGERPRINT_OFFSET] ^= 0xFF
    elif damage == "magic":
        mm[0:8] = b"XXXXXXXX"
    elif damage == "header":  # a hostile header: layout claims more blocks than the file holds
        body = msgspec.json.encode({"pid": 1, "start_ticks": 1, "engine_id": 1, "data_offset": 1 << 21,
                                    "created_s": 0.0, "layout": {"num_layers": 2, "block_size": 16,
                                                                 "num_kv_heads": 2, "head_dim": 16,
                                                                 "dtype": "bfloat16", "num_blocks": 1 << 30}})
        mm[12:16] = len(body).to_bytes(4, "little")
        mm[16:16 + len(body)] = body
    elif damage == "gone":
        seg.path.unlink()
    elif damage == "name":
        name = "passwd"
    elif damage == "traversal":
        name = "../engine1-1.kv"
    b = _core(tiny_moe, 2, monkeypatch)
    if damage == "own":
        name = b.runner.kv_segment.name
    rest = _replay(b, emitted, name)
    assert b.salvage.num_blocks == 0 and b.salvage.num_refused == 1
    if _exact(b):
        assert emitted + rest == reference


def test_a_live_writer_reusing_a_block_mid_copy_is_caught():
    """The reader's seqlock: a block reallocated (seq made odd) while it was copied is not
    trusted, nor any after it."""
    d = Path("/dev/shm") / f"planaria-test-{uuid.uuid4().hex[:12]}"
    d.mkdir(mode=0o700)
    try:
        layout = kv_segment.KVLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float32",
                                     num_blocks=8)
        fp = kv_segment.fingerprint("m", "", layout)
        w = kv_segment.KVSegment(d, 3, layout, fp)
        for b in range(8):
            w.blocks[:, :, b] = float(b)
            w.commit(b, 1000 + b)
        r = kv_segment.SalvageSource(d, w.name, layout, fp)
        assert r.writer_alive
        run = r.find_run([1000, 1001, 1002, 1003, 999])
        assert [b for b, _ in run] == [0, 1, 2, 3]
        w.invalidate([2])  # reused by the writer while the reader copies
        assert r.still_valid(run) == 2
        w.commit(2, 1002)  # committed again: a new seq, still not the one read
        assert r.still_valid(run) == 2
        w.invalidate_all(kv_segment.fingerprint("m", "v2", layout))  # a weight swap
        assert r.still_valid(run[:2]) == 0
        r.close()
        with pytest.raises(kv_segment.SalvageRefused, match="fingerprint"):
            kv_segment.SalvageSource(d, w.name, layout, fp)
        r = kv_segment.SalvageSource(d, w.name, layout, kv_segment.fingerprint("m", "v2", layout))
        assert r.find_run([1000]) == []  # nothing committed since
        r.close()
        assert oct(os.stat(w.path).st_mode & 0o777) == "0o600"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_record_is_linear_and_bounded(tmp_path):
    """The record is one (hash, seq) pair per block, read with numpy: no per-byte Python work."""
    layout = kv_segment.KVLayout(num_layers=1, block_size=16, num_kv_heads=1, head_dim=8, dtype="float32",
                                 num_blocks=4096)
    fp = kv_segment.fingerprint("m", "", layout)
    w = kv_segment.KVSegment(tmp_path, 0, layout, fp)
    w.hashes[:] = np.arange(4096, dtype=np.uint64) + np.uint64(7)
    w.seqs[:] = np.uint64(2)
    r = kv_segment.SalvageSource(tmp_path, w.name, layout, fp)
    assert len(r.find_run([7 + i for i in range(4096)])) == 4096
    r.close()


def test_prefetch_copies_the_bulk_while_the_source_decodes(tiny_moe, seg_dir, reference, monkeypatch):
    """A handover's pre-copy: the survivor adopts what the draining engine committed so far
    while it keeps decoding; the move then copies only the blocks committed since."""
    a = _core(tiny_moe, 1, monkeypatch)
    a.add_request(_req("r", PROMPT, TOTAL))
    early = _run(a, "r", limit=4)
    b = _core(tiny_moe, 2, monkeypatch)
    bs = b.kv.block_size
    assert b.prefetch_kv(a.runner.kv_segment.name, PROMPT + early) == (len(PROMPT) + len(early) - 1) // bs
    emitted = early + _run(a, "r", limit=CUT - len(early))  # the source went on meanwhile
    emitted = emitted[:CUT]
    before = b.salvage.num_blocks
    rest = _replay(b, emitted, a.runner.kv_segment.name)
    context = len(PROMPT) + len(emitted)
    # the blocks filled since, and the partial last one
    assert b.salvage.num_blocks - before == (context - 1) // bs - (len(PROMPT) + len(early) - 1) // bs + 1
    if _exact(b):
        assert emitted + rest == reference


@pytest.mark.parametrize("args", [
    {"segment": "engine1-1.kv", "token_ids": [10**9]},
    {"segment": "engine1-1.kv", "token_ids": "abc"},
    {"segment": "engine1-1.kv", "token_ids": [1] * 100_000},
    {"segment": "x" * 1000, "token_ids": [1, 2]},
    {"segment": "engine1-1.kv", "token_ids": [1, 2], "cache_salt": ""},
])
def test_prefetch_refuses_hostile_arguments(tiny_moe, seg_dir, monkeypatch, args):
    b = _core(tiny_moe, 2, monkeypatch)
    with pytest.raises(ValueError):
        b.prefetch_kv(**args)
    assert b.prefetch_kv("engine7-7.kv", [1] * 40) == 0  # no such segment: nothing adopted, no error


def test_copy_blocks_runs_and_scattered(tmp_path):
    """Blocks copied by runs where both sides are consecutive, one by one elsewhere: every
    destination block holds its source block, nothing else is touched."""
    layout = kv_segment.KVLayout(num_layers=2, block_size=2, num_kv_heads=1, head_dim=4, dtype="float32",
                                 num_blocks=16)
    fp = kv_segment.fingerprint("m", "", layout)
    w = kv_segment.KVSegment(tmp_path, 0, layout, fp)
    plane = np.array([[0.0, 100.0], [1000.0, 1100.0]], dtype=np.float32)[:, :, None]  # layer, K/V
    for b in range(16):
        w.blocks[:, :, b] = torch.from_numpy(plane + float(b + 1))
    r = kv_segment.SalvageSource(tmp_path, w.name, layout, fp)
    dst = np.zeros((2, 2, 16, 8), dtype=np.float32)
    d = torch.from_numpy(dst)
    src_ids, dst_ids = [3, 4, 5, 9, 2, 10, 11], [0, 1, 2, 7, 3, 12, 13]
    kv_segment.copy_blocks(d, r, src_ids, dst_ids)
    for s_, d_ in zip(src_ids, dst_ids):
        assert (dst[:, :, d_] == plane + s_ + 1).all()
    untouched = [b for b in range(16) if b not in dst_ids]
    assert (dst[:, :, untouched] == 0).all()
    # the file cut short under the reader (by a hostile or broken peer): refused, no SIGBUS
    os.truncate(w.path, w.data_offset + 64)
    with pytest.raises(kv_segment.SalvageRefused, match="cut short"):
        kv_segment.copy_blocks(d, r, [12], [0])
    r.close()


def test_a_salvaged_partial_block_is_taken_only_after_its_own_prefix_and_never_leaks():
    """KVCacheManager's tail: taken by the first allocation when the prefix hits are exactly
    the full blocks it follows; otherwise (a hit evicted meanwhile), or when the request
    ends first, or at a prefix-cache reset, the block goes back to the free list."""
    from planaria.engine.block_pool import hash_request_blocks
    from planaria.engine.kv_cache_manager import KVCacheManager
    from planaria.engine.request import Request

    def request(rid):
        return Request(rid, list(range(1, 12)), SamplingParams(max_tokens=4, temperature=0.0), None, 4)

    kv = KVCacheManager(num_blocks=8, block_size=4)
    free = kv.pool.num_free_blocks
    hashes = hash_request_blocks(list(range(1, 12)), 4, [])
    assert kv.import_blocks(hashes[:2], lambda dst: len(dst)) == 2  # blocks 0-1 cached
    req = request("a")
    assert kv.adopt_tail("a", 2, 2, lambda block: True)
    hits, num = kv.get_computed_blocks(req)
    assert len(hits) == 2 and num == 10  # 8 + the tail's 2: one token left to compute
    req.num_computed_tokens = num
    blocks = kv.allocate_slots(req, 1, hits)
    assert blocks[:2] == hits and len(blocks) == 3 and not kv._tails
    kv.free(req)
    assert kv.pool.num_free_blocks == free

    assert kv.adopt_tail("b", 3, 2, lambda block: True)  # follows 3 full blocks: only 2 are cached
    req = request("b")
    hits, num = kv.get_computed_blocks(req)
    assert len(hits) == 2 and num == 8
    req.num_computed_tokens = num
    assert len(kv.allocate_slots(req, 3, hits)) == 3 and not kv._tails
    kv.free(req)
    assert kv.pool.num_free_blocks == free

    assert kv.adopt_tail("c", 2, 2, lambda block: True)
    kv.free(request("c"))  # aborted while it waited
    assert not kv.adopt_tail("d", 2, 2, lambda block: False)  # the copy was not trusted
    assert kv.adopt_tail("e", 2, 2, lambda block: True)
    kv.reset_prefix_cache()
    assert not kv._tails and kv.pool.num_free_blocks == free


def _other_node(seg_dir: Path, monkeypatch) -> Path:
    """A segment dir of its own: engines made next see none of the first dir's segments."""
    other = seg_dir.with_name(seg_dir.name + "-b")
    other.mkdir(mode=0o700)
    monkeypatch.setenv(kv_segment.SEGMENT_DIR_ENV, str(other))
    return other


def test_a_handover_to_another_node_relays_the_blocks_in_bounded_parts(tiny_moe, seg_dir, reference, monkeypatch):
    """The survivor cannot read the draining engine's segment (another node): the blocks
    come through export_kv / import_kv, a few at a time, checked, and the move computes only
    what they lack, with the same tokens."""
    from planaria.engine import kv_transfer

    a, emitted = _die_after(tiny_moe, monkeypatch)
    other = _other_node(seg_dir, monkeypatch)
    try:
        b = _core(tiny_moe, 2, monkeypatch)
        tokens = PROMPT + emitted
        assert b.prefetch_kv(a.runner.kv_segment.name, tokens) == 0  # not on this node
        bs = b.kv.block_size
        per_block = 2 * a.runner.kv_layout.num_layers * bs * a.runner.kv_layout.num_kv_heads \
            * a.runner.kv_layout.head_dim * a.runner.kv_layout.elem_bytes
        start, parts, taken = 0, 0, 0
        while True:
            part = kv_transfer.export_kv(a, tokens, start_block=start, max_bytes=2 * per_block)
            if not part["hashes"]:
                break
            assert len(part["hashes"]) <= 2 and len(part["data"]) == len(part["hashes"]) * per_block
            taken += kv_transfer.import_kv(b, tokens, part["hashes"], part["data"], part["fingerprint"],
                                           part["layout"], start_block=start)["blocks"]
            start += len(part["hashes"])
            parts += 1
        full = (len(tokens) - 1) // bs
        assert taken == start == full and parts == -(-full // 2)
        prefill_before = b.scheduler.num_prefill_tokens
        rest = _replay(b, emitted, a.runner.kv_segment.name)  # its segment: not seen here, refused
        assert b.scheduler.num_prefill_tokens - prefill_before == len(tokens) - full * bs
        if _exact(b):
            assert emitted + rest == reference
    finally:
        shutil.rmtree(other, ignore_errors=True)


@pytest.mark.parametrize("damage", ["fingerprint", "layout", "hashes", "other-tokens", "salt", "short", "long",
                                    "type"])
def test_import_kv_checks_every_byte_before_use(tiny_moe, seg_dir, monkeypatch, damage):
    from planaria.engine import kv_transfer

    a, emitted = _die_after(tiny_moe, monkeypatch)
    other = _other_node(seg_dir, monkeypatch)
    try:
        b = _core(tiny_moe, 2, monkeypatch)
        tokens = PROMPT + emitted
        part = kv_transfer.export_kv(a, tokens)
        assert part["hashes"]
        args = dict(token_ids=tokens, hashes=part["hashes"], data=part["data"], fingerprint=part["fingerprint"],
                    layout=part["layout"])
        if damage == "fingerprint":
            args["fingerprint"] = bytes(32)
        elif damage == "layout":
            args["layout"] = dict(part["layout"], dtype="float16" if part["layout"]["dtype"] != "float16" else "float32")
        elif damage == "hashes":
            args["hashes"] = part["hashes"][1:] + part["hashes"][:1]
        elif damage == "other-tokens":
            args["token_ids"] = [7] + tokens[1:]
        elif damage == "salt":
            args["cache_salt"] = "tenant-b"
        elif damage == "short":
            args["data"] = part["data"][:-1]
        elif damage == "long":
            args["data"] = part["data"] + b"\0"
        else:
            args["data"] = list(part["data"][:8])
        free = b.kv.pool.num_free_blocks
        with pytest.raises(ValueError):
            kv_transfer.import_kv(b, **args)
        assert b.kv.pool.num_free_blocks == free and b.kv.pool.lookup(part["hashes"][0]) is None
        # and the export gives nothing to a caller without the tokens' salt
        assert kv_transfer.export_kv(a, tokens, cache_salt="tenant-b")["hashes"] == []
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_a_request_routed_away_copies_a_live_peers_prefix(tiny_moe, seg_dir, reference, monkeypatch):
    """The node-wide prefix cache: engine a holds a prompt's blocks (it ran it and keeps
    serving); a request with that prompt sent to engine b naming a's segment (kv_peer, the
    router's BALANCE) copies those blocks instead of computing them, and its tokens are the
    uninterrupted run's. A peer that is not on this node (no such file) or a request that
    wants prompt logprobs copies nothing and is computed as usual."""
    a = _core(tiny_moe, 1, monkeypatch)
    a.add_request(_req("warm", PROMPT, 4))
    _run(a, "warm")
    a.add_request(_req("busy", PROMPT[:20], 200))  # a keeps running while b copies
    _run(a, "busy", limit=2)
    b = _core(tiny_moe, 2, monkeypatch)
    bs = b.kv.block_size
    prefill_before = b.scheduler.num_prefill_tokens
    b.add_request(_req("r", PROMPT, TOTAL, kv_peer=a.runner.kv_segment.name))
    out = _run(b, "r")
    assert b.salvage.num_peer_blocks == (len(PROMPT) - 1) // bs and b.salvage.num_peer_requests == 1
    assert b.scheduler.num_prefill_tokens - prefill_before == len(PROMPT) - (len(PROMPT) - 1) // bs * bs
    assert b.salvage.num_requests == 0  # not counted as a salvage
    if _exact(b):
        assert out == reference
    c = _core(tiny_moe, 3, monkeypatch)
    c.add_request(_req("r", PROMPT, 4, kv_peer="engine9-99999.kv"))
    _run(c, "r")
    c.add_request(EngineCoreRequest(request_id="p", prompt_token_ids=PROMPT[:40] + [7] * 10,
                                    sampling_params=SamplingParams(max_tokens=2, prompt_logprobs=1),
                                    kv_peer=a.runner.kv_segment.name))
    _run(c, "p")
    assert c.salvage.num_peer_blocks == 0 and c.salvage.num_peer_requests == 1
