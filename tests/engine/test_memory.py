"""engine/memory.py: CPU allocator tuning and the KV cache's background prefault."""

from __future__ import annotations

import mmap

import psutil
import torch

from engine.memory import populate_in_background, tune_cpu_allocator


def test_allocator_tuning_is_idempotent():
    assert tune_cpu_allocator() is True  # glibc here
    assert tune_cpu_allocator() is True


def test_populate_makes_pages_resident_and_keeps_contents():
    nbytes = 64 * 2**20
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    t = torch.frombuffer(buf, dtype=torch.float32).view(4, -1)  # four regions, like K/V per layer
    t[1, 100:200] = 7.0  # written before: must survive
    rss0 = psutil.Process().memory_info().rss
    th = populate_in_background([t[i] for i in range(4)])
    assert th is not None and th.name == "kv-populate"
    t[2, -50:] = 3.0  # written while populating: must survive too
    th.join(timeout=60)
    assert not th.is_alive()
    grown = psutil.Process().memory_info().rss - rss0
    assert grown > 0.9 * nbytes, f"only {grown >> 20} MiB became resident"
    assert float(t[1, 100:200].sum()) == 700.0 and float(t[2, -50:].sum()) == 150.0
    assert float(t.abs().sum()) == 700.0 + 150.0  # everything else still zero


def test_populate_holds_the_mapping_while_it_runs():
    buf = mmap.mmap(-1, 16 * 2**20, flags=mmap.MAP_PRIVATE)
    t = torch.frombuffer(buf, dtype=torch.float32)
    th = populate_in_background([t])
    del t  # the thread keeps the tensor, and so the mapping, alive
    th.join(timeout=60)
    assert not th.is_alive()
