"""The frontend admin socket's error paths, over a real ipc socket and the blocking client
the supervisor uses; engines are fakes here (the real path is in test_weights_http.py).
An engine's refusal is judged by its code (UtilityCallError.code), never by its text."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

from planaria.common.admin_client import FrontendAdminClient
from planaria.common.envelope import ErrorCode
from planaria.common.errors import AdminError, ConflictError, NotRunningError, to_reply
from planaria.common.sockets import frontend_admin_socket_path
from planaria.engine.errors import UtilityCallError
from planaria.engine.wire import UtilityErrorCode
from planaria.frontend import admin
from tests.frontend._fakes import FakeEngineClient, FakeEngineInfo


class _UtilityClient(FakeEngineClient):
    """Engines that answer utility calls like engine.proc does (one refuses loads)."""

    def __init__(self, refusals: dict[int, UtilityCallError] | None = None) -> None:
        super().__init__()
        self.engines = [FakeEngineInfo(0), FakeEngineInfo(1), FakeEngineInfo(2, state="dead")]
        self.calls: list[tuple[int, str, dict]] = []
        self.refusals = refusals if refusals is not None else {
            1: UtilityCallError("WeightLoadError: /new is another architecture", UtilityErrorCode.BAD_ARGUMENT)}

    async def call_utility(self, index: int, method: str, args: dict | None = None, timeout_s: float = 30.0):
        self.calls.append((index, method, dict(args or {})))
        if method == "weight_status":
            return {"version": f"v{index}", "model_dir": "/m", "load": None}
        if index in self.refusals:
            raise self.refusals[index]
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
        c = FrontendAdminClient(runtime, timeout_s=5).call
        assert oct(frontend_admin_socket_path(runtime).stat().st_mode & 0o777) == "0o600"
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
    assert loads[-2:] == [(0, {"model_dir": "/new", "version": None, "mode": "hand_over"}),
                          (1, {"model_dir": "/new", "version": None, "mode": "hand_over"})]


def test_no_frontend_is_unavailable(tmp_path):
    with pytest.raises(NotRunningError, match="the frontend is not running") as info:
        FrontendAdminClient(tmp_path, timeout_s=1).call("weight_status")
    assert to_reply("r1", info.value).code is ErrorCode.UNAVAILABLE  # what the CLI then sees


_BUSY = "WeightLoadInProgressError: a weight load is already in progress (/old, reading)"


@pytest.mark.parametrize("refusals,expected", [
    # Every engine refused with "conflict": the load is a CONFLICT.
    ({0: UtilityCallError(_BUSY, UtilityErrorCode.CONFLICT),
      1: UtilityCallError(_BUSY, UtilityErrorCode.CONFLICT)}, ErrorCode.CONFLICT),
    # One refused for another reason: BAD_ARGUMENT.
    ({0: UtilityCallError(_BUSY, UtilityErrorCode.CONFLICT),
      1: UtilityCallError("WeightLoadError: no config.json", UtilityErrorCode.BAD_ARGUMENT)}, ErrorCode.BAD_ARGUMENT),
    # The code decides, not the text: an in-progress text with another code is no conflict.
    ({0: UtilityCallError(_BUSY, UtilityErrorCode.INTERNAL),
      1: UtilityCallError(_BUSY, UtilityErrorCode.INTERNAL)}, ErrorCode.BAD_ARGUMENT),
    ({0: asyncio.TimeoutError(), 1: UtilityCallError(_BUSY, UtilityErrorCode.CONFLICT)}, ErrorCode.BAD_ARGUMENT),
])
def test_refusals_are_judged_by_code(refusals, expected):
    engine_admin = admin.EngineAdmin(_UtilityClient(refusals))
    with pytest.raises(AdminError) as info:
        asyncio.run(engine_admin.load_weights("/new"))
    assert info.value.code is expected
    assert isinstance(info.value, ConflictError) == (expected is ErrorCode.CONFLICT)
    if expected is ErrorCode.CONFLICT:  # the engines' reason, without the exception's name
        assert str(info.value) == ("weights from /new not loaded: a weight load is already in "
                                   "progress (/old, reading)")


def test_fuzz_random_and_deeply_nested_requests_never_stop_the_admin_socket():
    """Real ipc socket, the server on the frontend's event loop: noise, mutated requests and
    msgpack nested past msgspec's recursion limit never end its reader; a well-formed call
    still gets its answer."""
    import random

    import msgspec
    import zmq

    from planaria.common.envelope import AdminRequest, Err, decode_reply, encode
    from tests.common._admin_fuzz import deep_request, fuzz_frames

    client = _UtilityClient()
    sockets = []

    async def run():
        runtime = Path(tempfile.mkdtemp(prefix="pl-adm-"))
        sock = admin.AdminSocket(admin.EngineAdmin(client), runtime)
        sockets.append(sock)
        sock.start()
        try:
            return await asyncio.to_thread(fuzz, runtime)
        finally:
            await sock.close()
            shutil.rmtree(runtime, ignore_errors=True)

    def fuzz(runtime: Path):
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(f"ipc://{frontend_admin_socket_path(runtime)}")
            dealer.send_multipart([b"", deep_request()])
            assert dealer.poll(10_000), "no answer: the admin socket's reader ended"
            first = decode_reply(dealer.recv_multipart()[-1])
            for frames in fuzz_frames(random.Random(99), 600):
                dealer.send_multipart(frames)
            dealer.send_multipart([b"", encode(AdminRequest(id="last", command="weight_status"))])
            while True:
                assert dealer.poll(60_000), "no answer to the last request"
                try:
                    reply = decode_reply(dealer.recv_multipart()[-1])
                except msgspec.DecodeError:
                    continue
                if reply.id == "last":
                    break
            status = FrontendAdminClient(runtime, timeout_s=10).call("weight_status")
            return first, reply, status
        finally:
            dealer.close(0)
            ctx.term()

    first, last, status = asyncio.run(run())
    assert isinstance(first, Err) and first.code is ErrorCode.BAD_ARGUMENT and "nested too deeply" in first.reason
    assert last.data["engines"]["0"]["version"] == "v0"
    assert status["engines"]["1"]["version"] == "v1"
    assert sockets[0].num_malformed > 10
