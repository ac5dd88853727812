"""Slot and Incarnation: what spans restarts, and what goes with one process."""

from __future__ import annotations

import dataclasses

import pytest

from planaria.daemon.launch import FRONTEND_KEY, engine_key
from planaria.daemon.slot import AfterExit, Incarnation, Slot, SlotState


class FakeChild:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def test_a_run_begins_at_spawn_and_is_dropped_whole_on_exit():
    slot = Slot(engine_key(3), extra_config={"kv_cache_bytes": 1 << 20})
    assert slot.current is None and slot.child is None and slot.pid is None
    assert slot.after_exit is AfterExit.UNPLANNED and slot.engine_id == 3
    first = slot.begin(FakeChild(11), now=5.0)
    assert slot.current is first and slot.pid == 11 and first.started_at == 5.0
    first.kill_reason, first.killed_stopped, first.death_reported = "hung", True, True
    first.after_exit, first.kill_at, first.heartbeat = AfterExit.RESTART, 9.0, object()
    assert slot.after_exit is AfterExit.RESTART
    assert slot.end() is first and slot.current is None and slot.after_exit is AfterExit.UNPLANNED
    second = slot.begin(FakeChild(12), now=6.0)
    assert second is not first and (second.pid, second.started_at) == (12, 6.0)
    fresh = {f.name: f.default for f in dataclasses.fields(Incarnation)
             if f.name not in ("child", "started_at")}
    assert {name: getattr(second, name) for name in fresh} == fresh
    assert slot.extra_config == {"kv_cache_bytes": 1 << 20}  # the slot's own: kept


def test_per_run_fields_live_only_on_the_incarnation():
    """A per-process field on the Slot would outlive its process; the slot's record has
    none, and a write of one (the old by-hand way) fails instead of lingering."""
    slot_fields = {f.name for f in dataclasses.fields(Slot)}
    run_fields = {f.name for f in dataclasses.fields(Incarnation)}
    assert not slot_fields & run_fields
    slot = Slot(FRONTEND_KEY)
    with pytest.raises(AttributeError):
        slot.kill_reason = "hung"  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        slot.after_exit = AfterExit.STOP  # type: ignore[misc]  # read-only: set on the run
    assert slot.engine_id is None and slot.state is SlotState.WAITING


def test_a_second_process_or_an_exit_without_one_is_refused():
    slot = Slot(engine_key(0))
    with pytest.raises(RuntimeError, match="no process to end"):
        slot.end()
    slot.begin(FakeChild(7), now=1.0)
    with pytest.raises(RuntimeError, match="already runs pid 7"):
        slot.begin(FakeChild(8), now=2.0)
    assert slot.pid == 7
