"""The frontend's admin socket: weight loads and weight status for the engines it holds.

Only the frontend holds the engines' sockets (they connect to its ROUTER), so an admin
command that must reach the engines (``planaria load-weights``) goes CLI -> supervisor
control socket -> this socket -> ``EngineClient.call_utility`` on each engine.

    ipc://<runtime dir>/fe<client index>-admin   ROUTER, file mode 0600 (like control.sock)
    frames [identity, b"", msgpack(AdminRequest)] in, [identity, b"", msgpack(Ok | Err)] out

The envelope, error codes and the blocking client (``FrontendAdminClient``, the
supervisor's side) are the admin protocol's, in planaria/common/. Commands, with their wire
forms::

    {"command": "load_weights", "args": {"model_dir": "/abs/dir", "mode": "hand_over",
                                         "engine_id": null, "version": null}}
        -> {"engines": {"0": {"load_id": "w1-...", "state": "reading", ...}, ...},
            "errors": {"1": "why engine 1 refused"}, "skipped": {"2": "dead"}}
    {"command": "weight_status", "args": {"engine_id": null}}
        -> {"engines": {"0": {"state": "running", "version": "...", "model_dir": "...",
                              "load": {"load_id", "state", "version", "error", ...} | null}}}

A load is accepted once the engines checked the directory and config (milliseconds); the
checkpoint is then read on each engine's own thread, and ``weight_status`` tells when it
is applied or failed. Every call here is bounded by ``utility_timeout_s``, so the caller
(the supervisor's loop) never waits long. An engine's refusal carries a code
(``UtilityCallError.code``): the load is a ``CONFLICT`` when every engine refused with
``conflict`` (a load already in progress), else a ``BAD_ARGUMENT``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from planaria.common.envelope import Err, ErrorCode, Ok, decode_request, encode
from planaria.common.errors import (BadArgumentError, ConflictError, UnavailableError, UnknownCommandError,
                                    UnknownEngineError, to_reply)
from planaria.common.sockets import frontend_admin_socket_path
from planaria.engine.errors import UtilityCallError
from planaria.engine.wire import UtilityErrorCode

log = logging.getLogger(__name__)

MODES = ("finish_old", "hand_over", "continue_new")  # engine/weight_update.py (not imported: it pulls in torch)
DEFAULT_UTILITY_TIMEOUT_S = 4.0


class EngineAdmin:
    """Weight operations over an ``EngineClient`` (anything with ``engines`` and
    ``call_utility``). Raises ``common.errors.AdminError`` subclasses."""

    def __init__(self, client, utility_timeout_s: float = DEFAULT_UTILITY_TIMEOUT_S) -> None:
        self.client = client
        self.utility_timeout_s = utility_timeout_s

    def _targets(self, engine_id: Any) -> tuple[list[int], dict[str, str]]:
        """(running engines to act on, {engine: state} of those skipped)."""
        engines = {e.index: e for e in self.client.engines}
        if engine_id is not None:
            if isinstance(engine_id, bool) or not isinstance(engine_id, int):
                raise BadArgumentError(f"engine_id must be an integer, got {engine_id!r}")
            if engine_id not in engines:
                known = ", ".join(map(str, sorted(engines))) or "none"
                raise UnknownEngineError(f"no engine {engine_id} is connected to the frontend (engines: {known})")
            if not engines[engine_id].healthy:
                raise UnavailableError(f"engine {engine_id} is {engines[engine_id].state}, not running")
            return [engine_id], {}
        running = [i for i, e in sorted(engines.items()) if e.healthy]
        if not running:
            raise UnavailableError("no engine is running")
        return running, {str(i): e.state for i, e in sorted(engines.items()) if not e.healthy}

    async def _call_each(self, indices: list[int], method: str, args: dict) -> list[Any]:
        """Results or exceptions, in order; never raises for one engine's failure."""
        return await asyncio.gather(*[self.client.call_utility(i, method, args, timeout_s=self.utility_timeout_s)
                                      for i in indices], return_exceptions=True)

    async def load_weights(self, model_dir: Any, mode: Any = "hand_over", engine_id: Any = None,
                           version: Any = None) -> dict:
        if not isinstance(model_dir, str) or not os.path.isabs(model_dir):
            raise BadArgumentError(f"model_dir must be an absolute directory path, got {model_dir!r}")
        if mode not in MODES:
            raise BadArgumentError(f"policy must be one of {', '.join(MODES)}, got {mode!r}")
        if version is not None and (not isinstance(version, str) or not version):
            raise BadArgumentError(f"version must be a non-empty string, got {version!r}")
        indices, skipped = self._targets(engine_id)
        results = await self._call_each(indices, "load_weights",
                                        {"model_dir": model_dir, "version": version, "mode": mode})
        started, errors = {}, {}
        for i, r in zip(indices, results):
            if isinstance(r, BaseException):
                errors[str(i)] = _reason(r)
            else:
                started[str(i)] = r
        if not started:  # every engine refused: nothing changed anywhere
            reasons = sorted(set(errors.values()))
            busy = all(isinstance(r, UtilityCallError) and r.code is UtilityErrorCode.CONFLICT for r in results)
            cls = ConflictError if busy else BadArgumentError
            raise cls(f"weights from {model_dir} not loaded: " + "; ".join(reasons))
        log.info("weight load started on engines %s from %s (%s)%s", sorted(started), model_dir, mode,
                 f"; refused by {errors}" if errors else "")
        return {"engines": started, "errors": errors, "skipped": skipped}

    async def weight_status(self, engine_id: Any = None) -> dict:
        if engine_id is None:
            indices = [e.index for e in self.client.engines if e.healthy]
        else:
            indices, _ = self._targets(engine_id)
        states = {e.index: e.state for e in self.client.engines}
        out: dict[str, dict] = {str(i): {"state": s} for i, s in states.items()
                                if engine_id is None and i not in indices}
        for i, r in zip(indices, await self._call_each(indices, "weight_status", {})):
            out[str(i)] = {"state": states.get(i, "unknown"),
                           **({"error": _reason(r)} if isinstance(r, BaseException) else r)}
        return {"engines": dict(sorted(out.items(), key=lambda kv: int(kv[0])))}

    async def weight_versions(self) -> dict[str, str]:
        """engine index -> weight version, for the running engines that answer in time."""
        status = await self.weight_status()
        return {i: s["version"] for i, s in status["engines"].items() if s.get("version")}


def _should_log(count: int) -> bool:
    """Per-message warnings: the first 20, then every 1000th (a flood must not fill the log)."""
    return count <= 20 or count % 1000 == 0


def _reason(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "the engine did not answer in time"
    text = str(exc) or type(exc).__name__  # an engine's refusal reads "WeightLoadError: why"
    return text.removeprefix("WeightLoadError: ").removeprefix("WeightLoadInProgressError: ")


class AdminSocket:
    """The ROUTER serving ``EngineAdmin`` on the frontend's event loop."""

    COMMANDS = ("load_weights", "weight_status")

    def __init__(self, admin: EngineAdmin, runtime_dir: str | os.PathLike, client_index: int = 0) -> None:
        self.admin = admin
        self.path = frontend_admin_socket_path(runtime_dir, client_index)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock = None
        self._task: asyncio.Task | None = None
        self._handlers: set[asyncio.Task] = set()
        self.num_malformed = 0  # requests with the wrong framing or that did not decode
        self.num_failed = 0  # requests whose answer raised (a bug: logged, left unanswered)

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"ipc://{self.path}")
        os.chmod(self.path, 0o600)
        self._task = asyncio.create_task(self._serve(), name="frontend-admin")

    async def _serve(self) -> None:
        """Read requests until closed; no request ends this loop (see _answer)."""
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                self.num_malformed += 1
                if _should_log(self.num_malformed):
                    log.warning("admin socket: dropping a message of %d frames", len(frames))
                continue
            task = asyncio.create_task(self._answer(frames[0], frames[2]))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _answer(self, identity: bytes, payload: bytes) -> None:
        try:
            reply = await self.dispatch(payload)
            await self._sock.send_multipart([identity, b"", encode(reply)])
        except zmq.ZMQError as exc:  # the caller went away
            log.warning("admin socket: reply not sent: %s", exc)
        except Exception:  # noqa: BLE001 - a bug: logged and counted, the socket serves on
            self.num_failed += 1
            if _should_log(self.num_failed):
                log.exception("admin socket: request #%d failed unanswered", self.num_failed)

    async def dispatch(self, payload: bytes) -> Ok | Err:
        try:
            request = decode_request(payload)
        except msgspec.DecodeError as exc:  # the only error it raises, deep nesting included
            self.num_malformed += 1
            return Err("", ErrorCode.BAD_ARGUMENT, f"malformed admin request: {exc}")
        try:
            if request.command not in self.COMMANDS:
                raise UnknownCommandError(f"unknown frontend admin command {request.command!r} "
                                          f"(known: {', '.join(self.COMMANDS)})")
            args = dict(request.args)
            unknown = set(args) - {"model_dir", "mode", "engine_id", "version"}
            if unknown:
                raise BadArgumentError(f"unknown arguments: {', '.join(sorted(unknown))}")
            if request.command == "load_weights":
                data = await self.admin.load_weights(**args)
            else:
                data = await self.admin.weight_status(args.get("engine_id"))
            return Ok(request.id, data)
        except Exception as exc:  # every failure becomes an Err reply
            err = to_reply(request.id, exc)
            if err.code is ErrorCode.INTERNAL:
                log.exception("frontend admin command %r failed", request.command)
            return err

    async def close(self) -> None:
        for task in [self._task, *self._handlers]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._task, *self._handlers] if t is not None],
                             return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._ctx.term()
            self.path.unlink(missing_ok=True)

