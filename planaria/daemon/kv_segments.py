"""The directory of the engines' KV segments: KV that outlives its engine (issue 29).

With ``planaria serve --kv-salvage on`` (the default) every engine core keeps its paged KV
cache in a file of a shared-memory directory, ``engine{ENGINE_ID}-{PID}.kv``, which it
finds in its environment as ``PLANARIA_KV_SEGMENT_DIR`` (daemon/launch.py; unset: private
memory, no salvage). When the engine dies (SIGKILL, OOM, a hang kill) or drains and
exits, its file stays for ``--kv-segment-ttl`` seconds so that a surviving engine on the
node can copy the KV blocks of its requests out of it instead of recomputing them; then
the supervisor removes it. This module is the daemon's half of that lifecycle:

- where: ``<runtime dir>/kv`` when the runtime dir is on a tmpfs (systemd's
  ``RuntimeDirectory=``, /run/planaria), else ``/dev/shm/planaria-{uid}-{16 hex digits of
  blake2b(the runtime dir's absolute path)}``: one directory per daemon (two daemons
  never share a runtime dir: its control socket says so), in memory either way;
- made 0700 by the supervisor at start and refused (``KVSegmentDirError``; the
  supervisor then turns salvage off with a warning) when it is a symlink, not a
  directory, or another user's: in the world-writable /dev/shm anyone could have made
  that name first;
- swept at start (the ``engine*.kv`` files a SIGKILLed daemon left), each dead engine's
  file removed when its time is up (``schedule_removal`` / ``tick``), and everything,
  the directory too, removed at a clean stop (``remove_all``).

Every operation goes through a descriptor of the directory opened with ``O_NOFOLLOW``
(``dir_fd=`` calls, no path is resolved twice), never follows a symlink (a symlink named
like a segment is unlinked itself, not its target), takes a file that vanished meanwhile
for removed, and is linear in the number of files.
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import os
import re
import stat
from pathlib import Path

from planaria.common.proc_stat import process_start
from planaria.daemon.errors import DaemonError

SEGMENT_DIR_ENV = "PLANARIA_KV_SEGMENT_DIR"  # the engines' side: engine/ reads it
SHM_ROOT = "/dev/shm"
MEMORY_FS_TYPES = ("tmpfs", "ramfs")
_SEGMENT = re.compile(r"engine(\d+)-(\d+)\.kv")


class KVSegmentDirError(DaemonError):
    """The KV segment directory cannot be used safely (a symlink, not a directory,
    another user's) or cannot be made."""


def segment_name(engine_id: int, pid: int) -> str:
    """The file name engine ``engine_id`` of process ``pid`` keeps its KV cache in."""
    return f"engine{int(engine_id)}-{int(pid)}.kv"


def segment_pid(name: str) -> int | None:
    """The pid of a segment file's name (None: not a segment's name)."""
    match = _SEGMENT.fullmatch(name)
    return int(match.group(2)) if match else None


def _unescape(field: str) -> str:
    """A mountinfo path: space, tab, newline and backslash come as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts(mountinfo: str) -> list[tuple[str, str, str]]:
    """(major:minor, mount point, file system type) of each line of /proc/self/mountinfo,
    in mount order (a later mount on the same point hides the earlier)."""
    mounts = []
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or not rest:
            continue
        mounts.append((fields[2], _unescape(fields[4]), rest[0]))
    return mounts


def filesystem_type(path: str | os.PathLike, mountinfo: str | None = None) -> str | None:
    """The type of the file system ``path`` is on ("tmpfs", "ext4", ...; None when unknown).

    The mount whose device is the path's own (st_dev against mountinfo's major:minor; the
    last of several) decides; where none matches (a btrfs subvolume, a path that does not
    exist yet), the mount with the longest mount point above the path's real path."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    mounts = _mounts(mountinfo)
    real = os.path.realpath(path)
    try:
        dev = os.stat(real).st_dev
    except OSError:
        dev = None
    if dev is not None:
        wanted = f"{os.major(dev)}:{os.minor(dev)}"
        on_dev = [m for m in mounts if m[0] == wanted]
        if on_dev:  # the same device mounted at several points: prefer one above the path
            above = [m for m in on_dev if _is_under(real, m[1])]
            return (above or on_dev)[-1][2]
    best: tuple[int, str] | None = None
    for _dev, point, fstype in mounts:
        if _is_under(real, point) and (best is None or len(point) >= best[0]):
            best = (len(point), fstype)
    return best[1] if best else None


def _is_under(path: str, point: str) -> bool:
    return point == "/" or path == point or path.startswith(point.rstrip("/") + "/")


def segment_dir_path(runtime_dir: str | os.PathLike, *, uid: int | None = None,
                     shm_root: str = SHM_ROOT, mountinfo: str | None = None) -> Path:
    """Where the engines of the daemon of ``runtime_dir`` keep their KV segments."""
    runtime = os.path.abspath(runtime_dir)
    if filesystem_type(runtime, mountinfo) in MEMORY_FS_TYPES:
        return Path(runtime) / "kv"
    digest = hashlib.blake2b(runtime.encode(), digest_size=8).hexdigest()
    return Path(shm_root) / f"planaria-{os.geteuid() if uid is None else uid}-{digest}"


OWNER_FILE = "owner"  # in a segment dir: "PID START_TICKS" of the daemon that holds it


def sweep_orphans(keep: Path, shm_root: str = SHM_ROOT) -> int:
    """Remove this user's ``planaria-UID-*`` segment dirs under ``shm_root`` (but ``keep``)
    whose owner daemon is gone (a daemon SIGKILLed, its runtime dir never used again: no
    later start of it would sweep them). A dir without a readable owner file is left alone.
    Returns how many were removed."""
    prefix = f"planaria-{os.geteuid()}-"
    removed = 0
    try:
        names = os.listdir(shm_root)
    except OSError:
        return 0
    for name in names:
        path = Path(shm_root) / name
        if not name.startswith(prefix) or path == keep:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            try:
                ofd = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError:
                continue
            with os.fdopen(ofd, "rb") as f:
                owner = f.read(64).split()
            try:
                pid, ticks = int(owner[0]), int(owner[1])
            except (IndexError, ValueError):
                continue
            if process_start(pid) == ticks:
                continue  # its daemon runs
            for entry in os.listdir(fd):
                if entry == OWNER_FILE or segment_pid(entry) is not None:
                    try:
                        os.unlink(entry, dir_fd=fd)
                    except OSError:
                        pass
        finally:
            os.close(fd)
        try:
            os.rmdir(path)
            removed += 1
        except OSError:
            pass
    return removed


class KVSegmentDir:
    """The directory, made (or taken, when safe) and held open; see the module's doc."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(os.path.abspath(path))
        self._fd: int | None = self._open(self.path)
        self._due: dict[int, float] = {}  # pid -> when its segments go
        self._heap: list[tuple[float, int]] = []  # (due, pid); stale entries skipped

    @classmethod
    def for_runtime_dir(cls, runtime_dir: str | os.PathLike, **kwargs) -> KVSegmentDir:
        return cls(segment_dir_path(runtime_dir, **kwargs))

    @staticmethod
    def _open(path: Path) -> int:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise KVSegmentDirError(f"cannot make the KV segment dir {path}: {exc}") from exc
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise KVSegmentDirError(f"KV segment dir {path} is a symlink or not a directory: "
                                        "refusing it") from exc
            raise KVSegmentDirError(f"cannot open the KV segment dir {path}: {exc}") from exc
        try:
            info = os.fstat(fd)
            if info.st_uid != os.geteuid():
                raise KVSegmentDirError(
                    f"KV segment dir {path} is owned by uid {info.st_uid}, not by this user "
                    f"(uid {os.geteuid()}): refusing it (whoever owns it could read the KV "
                    "cache, i.e. the prompts, or plant segments)")
            if stat.S_IMODE(info.st_mode) != 0o700:
                os.fchmod(fd, 0o700)  # mkdir's mode went through the umask; or an old one
        except BaseException:
            os.close(fd)
            raise
        return fd

    @property
    def closed(self) -> bool:
        return self._fd is None

    def _entries(self) -> list[str]:
        if self._fd is None:
            return []
        return os.listdir(self._fd)

    def _unlink(self, name: str) -> bool:
        """Unlink ``name`` (a symlink itself, never its target); False when it is gone
        already or is a directory."""
        try:
            os.unlink(name, dir_fd=self._fd)
        except FileNotFoundError:
            return False
        except (IsADirectoryError, PermissionError):  # a directory (EISDIR, or EPERM)
            return False
        return True

    # -- the lifecycle --------------------------------------------------------------------
    def sweep(self) -> int:
        """At start: remove every ``engine*.kv`` left by an earlier daemon (none of its
        engines outlived it: they die with their supervisor); returns how many. Then say
        whose the directory is (``owner``: this daemon's pid and start time), and remove the
        directories under /dev/shm of this user's daemons that died without cleaning up and
        whose runtime dir was another (``sweep_orphans``)."""
        removed = sum(self._unlink(name) for name in self._entries()
                      if name.startswith("engine") and name.endswith(".kv"))
        if self._fd is not None:
            fd = os.open(OWNER_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=self._fd)
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()} {process_start(os.getpid()) or 0}\n")
        if self.path.parent == Path(SHM_ROOT):
            sweep_orphans(self.path)
        return removed

    def schedule_removal(self, pid: int, at_monotonic: float) -> None:
        """Remove the segments of process ``pid`` at ``at_monotonic`` (the later of two
        schedules of one pid wins)."""
        if self._due.get(pid, float("-inf")) >= at_monotonic:
            return
        self._due[pid] = at_monotonic
        heapq.heappush(self._heap, (at_monotonic, pid))

    def cancel(self, pid: int) -> None:
        self._due.pop(pid, None)

    def pending(self) -> dict[int, float]:
        """{pid: when its segments are removed}."""
        return dict(self._due)

    def next_due(self) -> float | None:
        while self._heap and self._due.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)  # cancelled, or scheduled again later
        return self._heap[0][0] if self._heap else None

    def tick(self, now: float, live_pids=()) -> int:
        """Remove the files ``engine\\d+-{pid}.kv`` of every pid due by ``now``; returns
        how many. A due pid that is live again (a child got the pid meanwhile) keeps its
        files: they are that child's, scheduled when it exits."""
        due: set[int] = set()
        while (when := self.next_due()) is not None and when <= now:
            _when, pid = heapq.heappop(self._heap)
            del self._due[pid]
            due.add(pid)
        due -= set(live_pids)
        if not due:
            return 0
        return sum(self._unlink(name) for name in self._entries() if segment_pid(name) in due)

    def unscheduled(self, live_pids=()) -> set[int]:
        """The pids of segment files that belong to no live process given and whose
        removal is not scheduled (an exit the supervisor never saw)."""
        live = set(live_pids)
        pids = {segment_pid(name) for name in self._entries()}
        return {pid for pid in pids if pid is not None and pid not in live and pid not in self._due}

    def usage(self) -> dict:
        """{"dir", "num_files", "bytes" (memory the segment files hold), "num_kept"
        (processes whose files wait for their removal), "free_bytes" (room left on its
        tmpfs: a segment that outgrows it faults)} for `planaria status`."""
        num_files = num_bytes = 0
        for name in self._entries():
            if segment_pid(name) is None:
                continue
            try:
                info = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(info.st_mode):
                num_files += 1
                num_bytes += info.st_blocks * 512
        fs = os.fstatvfs(self._fd) if self._fd is not None else None
        return {"dir": str(self.path), "num_files": num_files, "bytes": num_bytes,
                "num_kept": len(self._due),
                "free_bytes": fs.f_bavail * fs.f_frsize if fs is not None else None}

    def remove_all(self) -> int:
        """At a clean stop: every file in the directory, then the directory itself;
        returns how many files. The object is closed afterwards."""
        if self._fd is None:
            return 0
        removed = sum(self._unlink(name) for name in self._entries())
        self._due.clear()
        self._heap.clear()
        self.close()
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            pass
        except OSError:  # something else in it (a directory): leave it
            pass
        return removed

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __repr__(self) -> str:
        return f"KVSegmentDir({str(self.path)!r})"
