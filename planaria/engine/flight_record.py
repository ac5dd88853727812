"""The engine's flight record: which requests took their first step in the batch being
run, in a small memory-mapped file the supervisor reads when the engine dies.

Why: a request that crashes the engine process (a native crash, an abort, a hang the
supervisor kills) leaves no Python exception to pin it on, and the frontend's journal
replays every request of a dead engine on a survivor; replayed, a poison request takes
the survivor down too, with everyone on it. Most such requests crash the engine at their
first step (their prompt is what breaks it). So before each forward the engine writes the
ids of the requests whose first chunk is in that batch; the supervisor reads the record of
a dead engine and sends those ids as the death's *suspects* (engine/wire.py EngineDead),
and the journal pins the crash on a sole suspect instead of replaying it
(frontend/journal.py). A decode-only batch writes an empty record: no request is pinned.

Layout (little-endian): ``seq u64 | step u64 | length u32 | ids (\\n-joined UTF-8)``,
4 KiB in all (ids that do not fit are dropped, and the record says so by ending in
``\\n...``). ``seq`` is odd while the writer is in the middle of a record and even once it
is whole, and the reader accepts a record only when ``seq`` is even and the same before
and after it read the rest: a crash mid-write leaves no record, never a wrong one.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

SIZE = 4096
_HEAD = struct.Struct("<QQI")
_TRUNCATED = b"\n..."


class FlightRecorder:
    """The writer (the engine's loop thread)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._seq = 0
        self._last: tuple[str, ...] = ()

    def record(self, step: int, first_step_ids: list[str]) -> None:
        """Before a forward: the requests whose first chunk is in it (cheap when nothing
        changed: an empty batch after an empty one writes nothing)."""
        ids = tuple(first_step_ids)
        if not ids and not self._last:
            return
        self._last = ids
        data = "\n".join(ids).encode()
        room = SIZE - _HEAD.size
        if len(data) > room:
            data = data[:room - len(_TRUNCATED)].rsplit(b"\n", 1)[0] + _TRUNCATED
        m = self._map
        self._seq += 1
        m[0:8] = struct.pack("<Q", self._seq)  # odd: being written
        m[_HEAD.size:_HEAD.size + len(data)] = data
        m[0:_HEAD.size] = _HEAD.pack(self._seq, step, len(data))
        self._seq += 1
        m[0:8] = struct.pack("<Q", self._seq)  # even: whole

    def close(self) -> None:
        self._map.close()


def read_suspects(path: str | os.PathLike) -> list[str] | None:
    """The ids of the last whole record (``[]``: the batch had no first step); None when
    there is no whole record (no file, never written, or written to when it died). Ids of a
    truncated record are returned without the ones that did not fit."""
    try:
        with open(path, "rb") as f:
            raw = f.read(SIZE)
    except OSError:
        return None
    if len(raw) < _HEAD.size:
        return None
    seq, _step, length = _HEAD.unpack_from(raw)
    if seq == 0 or seq % 2 or length > SIZE - _HEAD.size:
        return None
    data = raw[_HEAD.size:_HEAD.size + length]
    if data.endswith(_TRUNCATED):
        data = data[:-len(_TRUNCATED)]
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return None
    return [i for i in text.split("\n") if i]
