"""engine/memory.py: CPU allocator tuning.

``tune_cpu_allocator`` changes glibc's malloc for the whole process, so its effect is
measured in a fresh interpreter: the probe below mallocs through libc and reads
``mallinfo2`` (``hblkhd``: bytes in mmapped chunks; ``arena``: bytes of the sbrk heap).
The same probe without the tuning is the control: it shows that the figures tell the
two allocators apart.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from planaria.engine.memory import tune_cpu_allocator

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20

PROBE = """\
import ctypes, ctypes.util, json, sys
from planaria.engine.memory import tune_cpu_allocator

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
MiB = 2**20

def figures():
    m = libc.mallinfo2()
    return m.arena, m.hblkhd

result = {"tuned": tune_cpu_allocator() if sys.argv[1] == "tuned" else None}
heap0, mapped0 = figures()
block = libc.malloc(16 * MiB)       # an activation-sized temporary
heap1, mapped1 = figures()
libc.free(block)
heap2, mapped2 = figures()
big = libc.malloc(128 * MiB)        # past the 32 MiB threshold and the heap's free top
heap3, mapped3 = figures()
libc.free(big)
result.update(mapped_16=mapped1 - mapped0, heap_growth_16=heap1 - heap0,
              heap_kept_after_free=heap2 - heap0, mapped_128=mapped3 - mapped2)
print(json.dumps(result))
"""


def _probe(mode: str) -> dict:
    # a bare environment: no GLIBC_TUNABLES or MALLOC_*_ variables to move glibc's defaults
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


needs_glibc_mallinfo2 = pytest.mark.skipif(
    not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2"),
    reason="no glibc >= 2.33 (mallinfo2): the allocator cannot be observed")


@needs_glibc_mallinfo2
def test_untuned_glibc_maps_each_large_temporary():
    """The control: glibc's default serves 16 MiB with its own mmap (unmapped on free),
    the page faults the tuning is there to avoid."""
    got = _probe("plain")
    assert got["mapped_16"] >= 16 * MiB and got["heap_growth_16"] < 16 * MiB, got


@needs_glibc_mallinfo2
def test_tuning_keeps_temporaries_on_the_heap():
    """M_MMAP_THRESHOLD 32 MiB: 16 MiB comes from the heap; M_TOP_PAD 64 MiB: the heap grows
    by the block plus the pad (less the little its top had free); M_TRIM_THRESHOLD 1 GiB:
    freeing it does not shrink the heap; a block past the threshold (and the heap's free
    top) is still mmapped."""
    got = _probe("tuned")
    assert got["tuned"] is True
    assert got["mapped_16"] == 0, got
    assert got["heap_growth_16"] >= (16 + 63) * MiB, got
    assert got["heap_kept_after_free"] == got["heap_growth_16"], got
    assert got["mapped_128"] >= 128 * MiB, got


def test_allocator_tuning_is_idempotent():
    assert tune_cpu_allocator() is True  # glibc here
    assert tune_cpu_allocator() is True
