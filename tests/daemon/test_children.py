"""The real spawner's children: process pidfds and exit sentinels (thread pidfds)."""

from __future__ import annotations

import os
import select
import signal
import sys
import time

import pytest

from planaria.daemon.children import ChildSpec, PopenSpawner

# A process that holds 1 GiB of touched memory (the kernel frees it after the threads
# are gone, before the process pidfd fires) and names its exit sentinels.
_CHILD = """
import sys, time
from planaria.engine.heartbeat import start_exit_sentinels
block = bytearray(1 << 30)
for i in range(0, len(block), 4096):
    block[i] = 1
print(*start_exit_sentinels(), flush=True)
time.sleep(600)
"""


def _thread_pidfds_supported() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid(), os.O_EXCL))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _thread_pidfds_supported(), reason="kernel without PIDFD_THREAD (Linux < 6.9)")
def test_exit_sentinels_fire_before_the_process_pidfd(tmp_path):
    out = tmp_path / "child.out"
    spec = ChildSpec(key=("engine", 0), argv=[sys.executable, "-c", _CHILD],
                     env=dict(os.environ, PYTHONPATH=os.getcwd()), log_path=str(out))
    child = PopenSpawner().spawn(spec)
    try:
        deadline = time.monotonic() + 60
        while not out.read_text().strip().split("\n")[-1][:1].isdigit():
            assert child.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        tids = [int(t) for t in out.read_text().strip().split("\n")[-1].split()]
        assert child.watch_threads(tids + [os.getpid()]) == 2  # not a thread of the child: refused
        sentinels = child.exit_sentinels()
        t0 = time.perf_counter()
        os.kill(child.pid, signal.SIGKILL)
        ready, _, _ = select.select(sentinels, [], [], 10)
        t_sentinel = time.perf_counter() - t0
        assert ready
        select.select([child.fileno()], [], [], 10)
        t_process = time.perf_counter() - t0
        print(f"sentinel {t_sentinel * 1e3:.1f} ms, process pidfd {t_process * 1e3:.1f} ms")
        assert t_sentinel < 0.05
        assert t_sentinel < t_process
        child.stop_watching_threads()
        assert child.exit_sentinels() == []
        assert child.poll() == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            child.popen.wait()
