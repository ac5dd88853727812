"""A process's identity beyond its pid: its start time (a reused pid is another process)."""

from __future__ import annotations

from pathlib import Path


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks after boot, /proc/PID/stat field 22; None: no
    such live process, or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    if not fields or fields[0] in ("Z", "X", "x"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None
