"""The supervisor's KV segment directory (``--kv-salvage on``; daemon/kv_segments.py): made
at the start, each exited process's file kept ``kv_segment_ttl_s`` for survivors to copy
from, files of no known process found and given the same delay, all removed at a clean
stop. A mixin of daemon/supervisor.py's Supervisor (its config, launcher, clock, log and
children)."""

from __future__ import annotations

from typing import Any

from planaria.daemon.kv_segments import KVSegmentDir, KVSegmentDirError

KV_ORPHAN_SCAN_S = 10.0  # how often the KV segment dir is looked at for files of no known process


class KVSegmentsMixin:
    def open_kv_segments(self, kv_segments: KVSegmentDir | None = None) -> KVSegmentDir | None:
        """With ``--kv-salvage on``: make (or take) the KV segment directory, remove what a
        previous daemon left there, and name it to the engines to come (before ``start``).
        A directory that is unsafe or cannot be made turns salvage off, with a warning:
        engines then keep their KV in private memory. ``kv_segments``: one made already
        (tests)."""
        if not self.config.kv_salvage or self.kv_segments is not None:
            return self.kv_segments
        segments = kv_segments
        try:
            segments = segments or KVSegmentDir.for_runtime_dir(self.config.runtime_dir)
            swept, free = segments.sweep(), segments.usage()["free_bytes"]
        except (KVSegmentDirError, OSError) as exc:
            if segments is not None:
                segments.close()
            self.kv_segments_error = str(exc)
            self.log.warning("KV salvage off: no usable KV segment directory; engines keep their KV "
                             "cache in private memory", error=str(exc))
            return None
        self.kv_segments = segments
        self.launcher.kv_segment_dir = str(segments.path)
        self._kv_orphan_scan_at = self.clock() + KV_ORPHAN_SCAN_S
        self.log.info("KV segments", dir=str(segments.path), swept=swept,
                      ttl_s=self.config.kv_segment_ttl_s, free_bytes=free)
        return segments

    def close_kv_segments(self) -> None:
        """At the end (every child gone): remove every segment and the directory."""
        segments, self.kv_segments = self.kv_segments, None
        if segments is None:
            return
        self.launcher.kv_segment_dir = ""
        try:
            removed = segments.remove_all()
        except OSError as exc:
            self.log.warning("could not remove the KV segment dir", dir=str(segments.path), error=str(exc))
            return
        self.log.info("KV segments removed", dir=str(segments.path), num_files=removed)

    def _keep_kv_segment(self, pid: int | None, now: float) -> None:
        """Process ``pid`` exited: its KV segment goes ``kv_segment_ttl_s`` from now."""
        if self.kv_segments is not None and pid is not None:
            self.kv_segments.schedule_removal(pid, now + self.config.kv_segment_ttl_s)

    def _tick_kv_segments(self, now: float) -> float | None:
        segments = self.kv_segments
        if segments is None:
            return None
        try:
            due, scan = segments.next_due(), now >= self._kv_orphan_scan_at
            live = {c.pid for c in self.live_children()} if scan or (due is not None and due <= now) else set()
            if due is not None and due <= now:
                removed = segments.tick(now, live)
                if removed:
                    self.log.debug("KV segments removed", num_files=removed)
            if scan:
                self._kv_orphan_scan_at = now + KV_ORPHAN_SCAN_S
                for pid in segments.unscheduled(live):
                    self._keep_kv_segment(pid, now)
        except OSError as exc:  # the directory went away: nothing to hold there any more
            self.log.warning("KV segment dir unusable", dir=str(segments.path), error=str(exc))
            return None
        return min(t for t in (segments.next_due(), self._kv_orphan_scan_at) if t is not None)

    def kv_segments_status(self) -> dict[str, Any] | None:
        if self.kv_segments is not None:
            try:
                return self.kv_segments.usage()
            except OSError as exc:
                return {"dir": str(self.kv_segments.path), "error": str(exc)}
        if self.kv_segments_error is not None:
            return {"dir": None, "error": self.kv_segments_error}
        return None
