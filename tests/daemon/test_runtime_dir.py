"""The runtime directory holds the sockets engines and admins connect to, so nobody else may
write there, and the sockets are their owner's alone: a runtime dir that others may write
to, or that another user owns, is refused (with a clear message from `planaria serve`), and
the engine sockets the frontend binds there (fe0-in / fe0-out) are 0600 like the admin
socket: a local process must not pose as an engine and receive prompts."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from planaria.daemon.control import ensure_runtime_dir
from planaria.daemon.errors import RuntimeDirError
from planaria.engine.client import EngineClient

REPO = Path(__file__).resolve().parents[2]


def _dir(tmp_path: Path, mode: int) -> Path:
    path = tmp_path / f"run-{mode:o}"
    path.mkdir()
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o730, 0o707, 0o1777])
def test_a_runtime_dir_others_may_write_to_is_refused(tmp_path, mode):
    path = _dir(tmp_path, mode)
    with pytest.raises(RuntimeDirError, match=f"mode {stat.S_IMODE(mode):o}: others may create files"):
        ensure_runtime_dir(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user takes root")
def test_a_runtime_dir_of_another_user_is_refused(tmp_path):
    path = _dir(tmp_path, 0o700)
    os.chown(path, 65534, 65534)
    with pytest.raises(RuntimeDirError, match="owned by uid 65534, not by this user"):
        ensure_runtime_dir(path)


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755])
def test_a_private_or_read_only_runtime_dir_is_used_as_it_is(tmp_path, mode):
    path = _dir(tmp_path, mode)
    assert ensure_runtime_dir(path) == path
    assert stat.S_IMODE(path.stat().st_mode) == mode
    made = ensure_runtime_dir(tmp_path / "new" / "run")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


def test_serve_refuses_a_world_writable_runtime_dir_with_a_clear_error(tmp_path):
    path = _dir(tmp_path, 0o777)
    proc = subprocess.run(
        [sys.executable, "-m", "planaria.daemon.cli", "serve", "--model", str(tmp_path),
         "--state-dir", str(tmp_path / "state"), "--runtime-dir", str(path)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"planaria serve: runtime dir {path} has mode 777: others may create files" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (path / "control.sock").exists()


def test_the_engine_sockets_are_the_owners_alone(tmp_path):
    runtime_dir = ensure_runtime_dir(tmp_path / "rt")
    os.chmod(runtime_dir, 0o755)  # even where others may enter the directory

    async def bind() -> dict[str, int]:
        client = EngineClient(1, runtime_dir)
        client.bind()
        try:
            return {name: stat.S_IMODE(os.stat(runtime_dir / name).st_mode) for name in ("fe0-in", "fe0-out")}
        finally:
            await client.close()

    old_umask = os.umask(0o022)
    try:
        modes = asyncio.run(bind())
    finally:
        os.umask(old_umask)
    assert modes == {"fe0-in": 0o600, "fe0-out": 0o600}
    assert os.umask(old_umask) == old_umask  # the bind put the umask back
