"""Memory profiling for KV cache sizing.

GPU: CUDA peak-allocation statistics around a dummy forward. CPU: process RSS sampled by
a thread during the dummy forward (the high-water mark above the pre-forward baseline).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch


@dataclass
class MemoryProfile:
    budget_bytes: int  # memory the engine may use in total (before utilization)
    weights_bytes: int
    peak_activation_bytes: int
    kv_cache_bytes: int
    profile_s: float


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total)
    proc = psutil.Process()
    return int(psutil.virtual_memory().available + proc.memory_info().rss)


@contextmanager
def measure_peak(device: torch.device):
    """Yields a dict whose 'peak_bytes' is set on exit to the peak memory growth."""
    result = {"peak_bytes": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak_bytes"] = int(torch.cuda.max_memory_allocated(device) - base)
        return
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.0005)

    t = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    t.start()
    try:
        yield result
    finally:
        peak[0] = max(peak[0], proc.memory_info().rss)
        stop.set()
        t.join()
        result["peak_bytes"] = int(max(0, peak[0] - base))
