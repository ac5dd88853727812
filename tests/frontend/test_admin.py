"""The frontend admin socket's error paths, over a real ipc socket and the blocking client
the supervisor uses; engines are fakes here (the real path is in test_weights_http.py)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

from planaria.daemon.envelope import ErrorCode
from planaria.daemon.errors import AdminError, UnavailableError
from planaria.frontend import admin
from tests.frontend._fakes import FakeEngineClient, FakeEngineInfo


class _UtilityClient(FakeEngineClient):
    """Engines that answer utility calls like engine.proc does (one refuses loads)."""

    def __init__(self) -> None:
        super().__init__()
        self.engines = [FakeEngineInfo(0), FakeEngineInfo(1), FakeEngineInfo(2, state="dead")]
        self.calls: list[tuple[int, str, dict]] = []

    async def call_utility(self, index: int, method: str, args: dict | None = None, timeout_s: float = 30.0):
        self.calls.append((index, method, dict(args or {})))
        if method == "weight_status":
            return {"version": f"v{index}", "model_dir": "/m", "load": None}
        if index == 1:
            raise RuntimeError("WeightLoadError: /new is another architecture")
        return {"load_id": "w1", "state": "reading"}


async def _with_socket(client, fn):
    runtime = Path(tempfile.mkdtemp(prefix="pl-adm-"))
    sock = admin.AdminSocket(admin.EngineAdmin(client), runtime)
    sock.start()
    try:
        return await asyncio.to_thread(fn, runtime)
    finally:
        await sock.close()
        assert not sock.path.exists()
        shutil.rmtree(runtime, ignore_errors=True)


def _code(fn) -> tuple[ErrorCode, str]:
    with pytest.raises(AdminError) as ei:
        fn()
    return ei.value.code, ei.value.reason


def test_errors_become_codes_and_engines_are_targeted():
    client = _UtilityClient()

    def calls(runtime: Path):
        c = lambda cmd, **a: admin.call(runtime, cmd, a, timeout_s=5)  # noqa: E731
        assert oct(admin.admin_socket_path(runtime).stat().st_mode & 0o777) == "0o600"
        out = {
            "unknown": _code(lambda: c("reboot")),
            "relative": _code(lambda: c("load_weights", model_dir="rel/dir")),
            "policy": _code(lambda: c("load_weights", model_dir="/new", mode="soon")),
            "engine": _code(lambda: c("load_weights", model_dir="/new", engine_id=9)),
            "dead": _code(lambda: c("load_weights", model_dir="/new", engine_id=2)),
            "extra": _code(lambda: c("weight_status", colour="red")),
            "refused": _code(lambda: c("load_weights", model_dir="/new", engine_id=1)),
            "partial": c("load_weights", model_dir="/new"),
            "status": c("weight_status"),
        }
        return out

    out = asyncio.run(_with_socket(client, calls))
    assert out["unknown"][0] is ErrorCode.UNKNOWN_COMMAND
    assert out["relative"][0] is ErrorCode.BAD_ARGUMENT and "absolute" in out["relative"][1]
    assert out["policy"][0] is ErrorCode.BAD_ARGUMENT and "finish_old" in out["policy"][1]
    assert out["engine"][0] is ErrorCode.UNKNOWN_ENGINE
    assert out["dead"][0] is ErrorCode.UNAVAILABLE and "dead" in out["dead"][1]
    assert out["extra"][0] is ErrorCode.BAD_ARGUMENT and "colour" in out["extra"][1]
    assert out["refused"] == (ErrorCode.BAD_ARGUMENT, "weights from /new not loaded: /new is another architecture")
    assert out["partial"] == {"engines": {"0": {"load_id": "w1", "state": "reading"}},
                              "errors": {"1": "/new is another architecture"}, "skipped": {"2": "dead"}}
    assert out["status"]["engines"] == {"0": {"state": "running", "version": "v0", "model_dir": "/m", "load": None},
                                        "1": {"state": "running", "version": "v1", "model_dir": "/m", "load": None},
                                        "2": {"state": "dead"}}
    loads = [(i, a) for i, m, a in client.calls if m == "load_weights"]
    assert loads[-2:] == [(0, {"model_dir": "/new", "version": None, "mode": "finish_old"}),
                          (1, {"model_dir": "/new", "version": None, "mode": "finish_old"})]


def test_no_frontend_is_unavailable(tmp_path):
    with pytest.raises(UnavailableError, match="does not exist"):
        admin.call(tmp_path, "weight_status", {}, timeout_s=1)
