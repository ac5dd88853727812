"""An engine's KV cache in a named shared-memory file that outlives the process (issue 29).

The supervisor gives each engine a directory on tmpfs (``PLANARIA_KV_SEGMENT_DIR``,
daemon/kv_segments.py); the engine puts its whole paged KV cache in one file there,
``engine{ID}-{PID}.kv``, mapped shared. A SIGKILL, an OOM kill or a hang-kill leaves the
file and its blocks in place; the supervisor removes it a while after the process exited.
A survivor that replays the dead engine's requests copies their committed blocks out of it
(``SalvageSource``) and recomputes only what was not committed; a draining engine hands its
requests over the same way (it drops them, they are replayed with ``kv_salvage`` naming its
file, and it writes no block while it drains).

Layout::

    [0, 4096)        header: MAGIC, version, header length, then msgspec JSON (SegmentHeader)
    [4096, 4096+32)  fingerprint of the weights and the KV layout (rewritten on a weight swap)
    [8192, ...)      the record: per block (hash u64, seq u64)
    [data_offset,)   K and V: [layers, 2, blocks * block_size, kv heads, head dim] (the dtype's)

The record is a per-block seqlock written only by the engine thread, in program order with
the forward's KV writes:

- a block handed out for writing (``invalidate``, at allocation, before any forward writes
  it) gets an odd seq: not to be trusted;
- a block whose every position a finished forward wrote (``commit``, after the step) gets its
  chained block hash, then an even seq (> 0);
- a request's last block, not full yet, is committed the same way after each step under the
  hash of its positions written so far (``block_pool.hash_partial_block``: the parent's hash,
  those tokens, their count). The next forward writes only positions after them, so the
  entry stays true while it runs; a survivor adopts that block too and computes from the
  first position it lacks (one token after a SIGKILL in decode, not the rest of the block).

A reader trusts a block when its seq is even, non-zero and the same before and after it
copied the block (x86 keeps stores in order and loads in order: a copy that saw a later
KV write also sees the odd seq written before it). A crash at any instant leaves each block
either committed with the hash its positions were computed for, or untrusted: positions a
forward was still writing are never trusted. Block hashes chain every token before them
(engine/block_pool.py), so a hash names the whole prefix, salt included: a block is only
ever adopted by a request whose tokens up to it are the same.

A GPU engine can keep the same record and header with its blocks in device memory exported
to a survivor (or staged through pinned host memory); only ``kv`` and the copy change.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import numpy as np
import torch

from planaria.common.logging import get_logger
from planaria.common.proc_stat import process_start
from planaria.engine.wire import KV_SEGMENT_NAME

log = get_logger("planaria.engine.kv_segment")

SEGMENT_DIR_ENV = "PLANARIA_KV_SEGMENT_DIR"
MAGIC = b"PLNKVSG1"
VERSION = 1
HEADER_BYTES = 4096
FINGERPRINT_OFFSET = 4096
FINGERPRINT_BYTES = 32
RECORD_OFFSET = 8192
ENTRY_BYTES = 16
DATA_ALIGN = 2 << 20
NAME_RE = KV_SEGMENT_NAME
MAX_HEADER_JSON = HEADER_BYTES - 16
MAX_BLOCKS = 1 << 26
COPY_THREADS = 2  # a salvage's readers (copy_blocks)


class SalvageRefused(Exception):
    """The segment cannot be used (gone, foreign, another model or layout, inconsistent)."""


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    num_blocks: int

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def data_bytes(self) -> int:
        return (self.num_layers * 2 * self.num_blocks * self.block_size * self.num_kv_heads
                * self.head_dim * self.elem_bytes)

    def compatible(self, other: "KVLayout") -> bool:
        """Same per-block shape and dtype (the number of blocks may differ)."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype) == (
            other.num_layers, other.block_size, other.num_kv_heads, other.head_dim, other.dtype)


class SegmentHeader(msgspec.Struct, kw_only=True):
    pid: int
    start_ticks: int  # /proc/PID/stat starttime: a reused pid is another process
    engine_id: int
    layout: KVLayout
    data_offset: int
    created_s: float


def segment_dir() -> Path | None:
    """The directory the supervisor gave this engine, or None (private KV, no salvage)."""
    value = os.environ.get(SEGMENT_DIR_ENV, "")
    if not value:
        return None
    path = Path(value)
    return path if path.is_dir() and not path.is_symlink() else None


def segment_name(engine_id: int, pid: int) -> str:
    return f"engine{engine_id}-{pid}.kv"


def fingerprint(model_id: str, weight_version: str, layout: KVLayout) -> bytes:
    """What a block's contents depend on besides its tokens: the weights and the layout."""
    import hashlib

    h = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
    for part in (model_id, weight_version, layout.dtype, str(layout.num_layers), str(layout.block_size),
                 str(layout.num_kv_heads), str(layout.head_dim)):
        h.update(part.encode("utf-8", "surrogatepass") + b"\x00")
    return h.digest()


MADV_POPULATE_WRITE = 23  # Linux 5.14: map the pages of a range now, write faults


def _populate(mm: mmap.mmap, start: int, length: int, advice: int) -> None:
    """Fault ``[start, start + length)`` of ``mm`` in at once (page aligned); nothing on a
    kernel without MADV_POPULATE_* (Linux < 5.14)."""
    page = mmap.PAGESIZE
    begin = start - start % page
    end = min(len(mm), -(-(start + length) // page) * page)
    try:
        mm.madvise(advice, begin, end - begin)
    except OSError as exc:
        import errno

        if exc.errno != errno.EINVAL:
            raise


def weights_identity(model_dir: str, version: str = "") -> str:
    """The weights in place, for the fingerprint: the checkpoint's config and each weight
    file's name, size and modification time (engines of one node read the same files), and
    the version a weight update named."""
    import hashlib

    d = Path(model_dir)
    h = hashlib.blake2b(digest_size=16)
    try:
        h.update((d / "config.json").read_bytes())
        for f in sorted(d.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}\x00{st.st_size}\x00{st.st_mtime_ns}\x00".encode("utf-8", "surrogatepass"))
    except OSError:
        h.update(str(d.absolute()).encode("utf-8", "surrogatepass"))
    h.update(version.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _data_offset(num_blocks: int) -> int:
    end = RECORD_OFFSET + num_blocks * ENTRY_BYTES
    return -(-end // DATA_ALIGN) * DATA_ALIGN


def _blocks_view(kv: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """[layers, 2, blocks, block_size * kv heads * head dim] over the same memory."""
    return kv.view(layout.num_layers, 2, layout.num_blocks,
                   layout.block_size * layout.num_kv_heads * layout.head_dim)


class KVSegment:
    """The writer: this engine's KV cache and its record, in ``directory``."""

    def __init__(self, directory: Path, engine_id: int, layout: KVLayout, fp: bytes) -> None:
        self.layout = layout
        self.name = segment_name(engine_id, os.getpid())
        self.path = directory / self.name
        self.data_offset = _data_offset(layout.num_blocks)
        size = self.data_offset + layout.data_bytes
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileExistsError:  # a dead process of this engine with this very pid left it
            self.path.unlink()
            fd = os.open(self.path, flags, 0o600)
        try:
            # The pages now, not at first touch: a tmpfs that is full (other engines' caches,
            # dead ones kept for salvage) fails here (ENOSPC: the caller falls back to
            # private memory), never with a SIGBUS in the middle of a forward. ~0.25 s per GiB.
            os.posix_fallocate(fd, 0, size)
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        header = SegmentHeader(pid=os.getpid(), start_ticks=process_start(os.getpid()) or 0,
                               engine_id=engine_id, layout=layout, data_offset=self.data_offset,
                               created_s=time.time())
        body = msgspec.json.encode(header)
        if len(body) > MAX_HEADER_JSON:
            raise ValueError("segment header too long")
        self._mm[16:16 + len(body)] = body
        self._mm[FINGERPRINT_OFFSET:FINGERPRINT_OFFSET + FINGERPRINT_BYTES] = fp
        self._mm[8:16] = VERSION.to_bytes(4, "little") + len(body).to_bytes(4, "little")
        self._mm[0:8] = MAGIC  # last: a reader never sees a half-written header
        record = np.frombuffer(self._mm, dtype=np.uint64, count=2 * layout.num_blocks, offset=RECORD_OFFSET)
        self.hashes = record[0::2]
        self.seqs = record[1::2]
        self.kv = torch.frombuffer(self._mm, dtype=getattr(torch, layout.dtype), offset=self.data_offset,
                                   count=layout.data_bytes // layout.elem_bytes).view(
            layout.num_layers, 2, layout.num_blocks * layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.blocks = _blocks_view(self.kv, layout)
        # Mapped in the background, so that a salvage writing a context's blocks at once
        # takes no page faults (two thirds of its time); the engine serves meanwhile.
        self._populating = threading.Thread(target=self._populate_all, name="kv-segment-populate", daemon=True)
        self._populating.start()

    def _populate_all(self) -> None:
        chunk = 64 << 20
        try:
            for start in range(self.data_offset, len(self._mm), chunk):
                _populate(self._mm, start, min(chunk, len(self._mm) - start), MADV_POPULATE_WRITE)
        except (OSError, ValueError):  # an old kernel, or the mapping closed: faults on first touch
            pass

    # -- the record (engine thread only) ------------------------------------------------
    def invalidate(self, block_ids) -> None:
        """Blocks about to be written: untrusted until committed again."""
        seqs = self.seqs
        for b in block_ids:
            s = int(seqs[b])
            if not s & 1:
                seqs[b] = s + 1

    def commit(self, block_id: int, block_hash: int) -> None:
        """Every position of the block was written by a finished forward for the tokens
        ``block_hash`` names."""
        s = int(self.seqs[block_id])
        if not s & 1 and s and int(self.hashes[block_id]) == block_hash:
            return  # already committed with this hash
        if not s & 1:
            s += 1
            self.seqs[block_id] = s
        self.hashes[block_id] = block_hash
        self.seqs[block_id] = s + 1

    def invalidate_all(self, fp: bytes | None = None) -> None:
        """A weight swap or a cache reset: nothing committed so far is valid any more."""
        odd = (self.seqs & np.uint64(1)) == 0
        self.seqs[odd] += np.uint64(1)
        if fp is not None:
            self._mm[FINGERPRINT_OFFSET:FINGERPRINT_OFFSET + FINGERPRINT_BYTES] = fp


class SalvageSource:
    """A reader of another engine's segment (dead, or alive and draining)."""

    def __init__(self, directory: Path, name: str, layout: KVLayout, fp: bytes) -> None:
        if not isinstance(name, str) or NAME_RE.match(name) is None:
            raise SalvageRefused(f"not a segment name: {name!r:.80}")
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise SalvageRefused(f"segment {name} is gone ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_size < RECORD_OFFSET:
                raise SalvageRefused(f"segment {name} is not ours or too short")
            # the header and the record; the blocks are read from the file (copy_blocks)
            self._mm = mmap.mmap(fd, min(st.st_size, RECORD_OFFSET + ENTRY_BYTES * MAX_BLOCKS),
                                 flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        try:
            self._check(name, st.st_size, layout, fp)
        except BaseException:
            self.close()
            raise

    def _check(self, name: str, size: int, layout: KVLayout, fp: bytes) -> None:
        mm = self._mm
        if mm[0:8] != MAGIC or int.from_bytes(mm[8:12], "little") != VERSION:
            raise SalvageRefused(f"segment {name}: not a KV segment of this version")
        n = int.from_bytes(mm[12:16], "little")
        if not 0 < n <= MAX_HEADER_JSON:
            raise SalvageRefused(f"segment {name}: bad header length")
        try:
            header = msgspec.json.decode(mm[16:16 + n], type=SegmentHeader)
        except msgspec.DecodeError as exc:
            raise SalvageRefused(f"segment {name}: bad header ({exc})") from None
        src = header.layout
        if not src.compatible(layout) or not 0 < src.num_blocks <= MAX_BLOCKS:
            raise SalvageRefused(f"segment {name}: KV layout {src} differs from this engine's {layout}")
        if header.data_offset != _data_offset(src.num_blocks) or size < header.data_offset + src.data_bytes:
            raise SalvageRefused(f"segment {name}: sizes do not add up")
        if self.fingerprint() != fp:
            raise SalvageRefused(f"segment {name}: other weights (fingerprint differs)")
        self.name, self.header, self.layout, self._fp = name, header, src, fp
        record = np.frombuffer(mm, dtype=np.uint64, count=2 * src.num_blocks, offset=RECORD_OFFSET)
        self.hashes, self.seqs = record[0::2], record[1::2]
        self.writer_alive = process_start(header.pid) == header.start_ticks and header.start_ticks != 0
        self._index: tuple[dict[int, int], np.ndarray] | None = None

    def fingerprint(self) -> bytes:
        return bytes(self._mm[FINGERPRINT_OFFSET:FINGERPRINT_OFFSET + FINGERPRINT_BYTES])

    def _committed(self) -> tuple[dict[int, int], np.ndarray]:
        """hash -> block of the blocks committed now, and the seqs read: one linear pass
        over the record, made once per source."""
        if self._index is None:
            seqs = self.seqs.copy()
            hs = self.hashes.copy()
            ok = (seqs != 0) & ((seqs & np.uint64(1)) == 0)
            self._index = (dict(zip(hs[ok].tolist(), np.flatnonzero(ok).tolist())), seqs)
        return self._index

    def find_run(self, hashes: list[int]) -> list[tuple[int, int]]:
        """(block, seq) of the leading run of ``hashes`` committed here: linear in the record
        plus the hashes."""
        where, seqs = self._committed()
        run = []
        for h in hashes:
            b = where.get(h)
            if b is None:
                break
            run.append((b, int(seqs[b])))
        return run

    def find(self, block_hash: int) -> tuple[int, int] | None:
        """(block, seq) of the block committed under ``block_hash`` (a partial block's too)."""
        where, seqs = self._committed()
        b = where.get(block_hash)
        return None if b is None else (b, int(seqs[b]))

    def still_valid(self, run: list[tuple[int, int]]) -> int:
        """How many leading blocks of ``run`` kept their seq (and the weights their
        fingerprint) while they were copied."""
        if self.fingerprint() != self._fp:
            return 0
        for i, (b, s) in enumerate(run):
            if int(self.seqs[b]) != s:
                return i
        return len(run)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self._mm.close()
        except BufferError:  # a view of the record is still alive; the mapping goes with it
            pass


_COPY_POOL: ThreadPoolExecutor | None = None


def _copy_pool() -> ThreadPoolExecutor:
    global _COPY_POOL
    if _COPY_POOL is None:
        _COPY_POOL = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="kv-salvage-copy")
    return _COPY_POOL


def copy_blocks(dst_blocks: torch.Tensor, src: SalvageSource, src_ids: list[int], dst_ids: list[int]) -> None:
    """K and V of ``src_ids`` (in ``src``) into ``dst_ids`` of this engine's cache.

    Read from the file with preadv straight into the cache's memory, runs consecutive in
    both (a request's blocks usually are, and free blocks taken together) one read per layer
    and K/V, on two threads: the kernel copies from the tmpfs pages, so the source is never
    mapped (mapping 190 MB page by page cost more than the copy: 8k tokens of SmolLM2 in 18
    ms against 35 ms mapped and copied). A file cut short under us fails the salvage (the
    request is recomputed), where a mapping would have raised SIGBUS."""
    if not src_ids:
        return
    layout = src.layout
    if dst_blocks.dim() != 4 or dst_blocks.shape[:2] != (layout.num_layers, 2) or not dst_blocks.is_contiguous() \
            or dst_blocks.device.type != "cpu":
        raise SalvageRefused("the destination is not a CPU cache of this layout")
    block_bytes = layout.block_size * layout.num_kv_heads * layout.head_dim * layout.elem_bytes
    plane = layout.num_blocks * block_bytes  # one layer's K (or V)
    runs = []
    start = 0
    for i in range(1, len(src_ids) + 1):
        if i == len(src_ids) or src_ids[i] != src_ids[i - 1] + 1 or dst_ids[i] != dst_ids[i - 1] + 1:
            runs.append((src_ids[start], dst_ids[start], i - start))
            start = i
    dst_bytes = dst_blocks.view(dst_blocks.shape[0], 2, dst_blocks.shape[2], -1).view(torch.uint8).numpy()
    fd, base = src.fd, src.header.data_offset

    def read(planes: range) -> None:
        for p in planes:
            layer, kv = divmod(p, 2)
            for s0, d0, n in runs:
                want = n * block_bytes
                if os.preadv(fd, [memoryview(dst_bytes[layer, kv, d0:d0 + n]).cast("B")],
                             base + p * plane + s0 * block_bytes) != want:
                    raise SalvageRefused(f"segment {src.name} was cut short")

    num_planes = layout.num_layers * 2
    if COPY_THREADS < 2 or num_planes < 2:
        read(range(num_planes))
        return
    half = num_planes // 2
    other = _copy_pool().submit(read, range(half, num_planes))
    try:
        read(range(half))
    finally:
        other.result()
