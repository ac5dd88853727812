"""The engine's flight record (engine/flight_record.py): what the supervisor reads of a
dead engine is the last whole record, never a torn one."""

from __future__ import annotations

import struct

from planaria.engine.flight_record import SIZE, FlightRecorder, read_suspects


def test_the_last_record_is_read_back(tmp_path):
    path = tmp_path / "engine-0.flight"
    assert read_suspects(path) is None  # no file: nothing known
    rec = FlightRecorder(path)
    assert read_suspects(path) is None  # created, never written
    rec.record(1, ["cmpl-a-0", "cmpl-b-0~r1"])
    assert read_suspects(path) == ["cmpl-a-0", "cmpl-b-0~r1"]
    rec.record(2, [])  # a decode-only batch: nobody is pinned
    assert read_suspects(path) == []
    rec.record(3, [])  # unchanged: not written again
    rec.record(4, ["cmpl-c-0"])
    assert read_suspects(path) == ["cmpl-c-0"]
    rec.close()
    assert path.stat().st_size == SIZE


def test_a_record_torn_by_the_crash_is_not_trusted(tmp_path):
    path = tmp_path / "engine-0.flight"
    rec = FlightRecorder(path)
    rec.record(1, ["cmpl-a-0"])
    rec.close()
    raw = bytearray(path.read_bytes())
    seq = struct.unpack_from("<Q", raw)[0]
    struct.pack_into("<Q", raw, 0, seq + 1)  # died between "writing" and "whole"
    path.write_bytes(bytes(raw))
    assert read_suspects(path) is None
    struct.pack_into("<QQI", raw, 0, seq, 1, SIZE)  # a length past the record: not trusted
    path.write_bytes(bytes(raw))
    assert read_suspects(path) is None


def test_too_many_ids_keep_those_that_fit(tmp_path):
    path = tmp_path / "engine-0.flight"
    ids = [f"cmpl-{i:040d}-0" for i in range(200)]
    FlightRecorder(path).record(1, ids)
    got = read_suspects(path)
    assert got and got == ids[:len(got)] and len(got) < len(ids)
