"""engine/memory.py: CPU allocator tuning."""

from __future__ import annotations

from planaria.engine.memory import tune_cpu_allocator


def test_allocator_tuning_is_idempotent():
    assert tune_cpu_allocator() is True  # glibc here
    assert tune_cpu_allocator() is True
