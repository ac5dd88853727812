"""Errors raised by the engine package. Exceptions become wire error codes in one place
(engine/proc.py); callers keep causes with ``raise ... from exc``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planaria.engine.wire import UtilityErrorCode


class EngineError(Exception):
    """Base class for every engine error."""


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt or sampling parameters) is not valid; only that request fails."""


class UnsupportedModelError(EngineError):
    """The checkpoint's architecture or a config value is not supported."""


class ModelLoadError(EngineError):
    """Weights or config could not be read from the model directory."""


class KVCacheTooSmallError(EngineError):
    """The KV cache cannot hold even one block, or one sequence of max_model_len."""



class EngineFaultError(EngineError):
    """An engine-level fault lost this request (engine died, stopped, or dropped its work).

    The request itself is not to blame, so a frontend may replay it on another engine.
    Every field may be None where it is not known.
    """

    _what = "fault"

    def __init__(self, engine_index: int | None = None, request_id: str | None = None,
                 reason: str = "") -> None:
        self.engine_index = engine_index
        self.request_id = request_id
        self.reason = reason
        what = f"engine {engine_index}" if engine_index is not None else "engine"
        for_req = f" (request {request_id})" if request_id is not None else ""
        head = f"{what} {self._what}{for_req}"
        super().__init__(f"{head}: {reason}" if reason else head)


class EngineHandshakeError(EngineError):
    """An engine and a frontend do not agree (protocol version, config hash) or never met."""


class ConfigMismatchError(EngineHandshakeError):
    """An engine and a frontend disagree on the protocol version or the config hash, so one
    refused the other: a configuration error that restarting the same engine cannot fix."""


class NoEngineAvailableError(EngineError):
    """No healthy engine can take a request right now."""


class UtilityCallError(EngineError):
    """A utility call reached the engine and failed there; the message is the engine's,
    ``code`` (a ``wire.UtilityErrorCode``) says why, for callers to decide on."""

    def __init__(self, message: str, code: "UtilityErrorCode") -> None:
        super().__init__(message)
        self.code = code


class EngineStateError(EngineError):
    """A utility call the engine's current state does not allow (pause when not running,
    reset while draining)."""


class FaultInjectionDisabledError(EngineError, PermissionError):
    """The fault_inject utility on an engine started without PLANARIA_FAULT_INJECTION=1."""


class EngineDeadError(EngineFaultError):
    """The engine core died (reported by itself or by the supervisor).

    ``EngineDeadError(engine_index, request_id, reason)``; raised promptly by every
    in-flight ``EngineClient.generate`` on that engine.
    """

    _what = "died"


class WireFormatError(EngineError, ValueError):
    """A socket message is malformed: unknown type, bad schema, too large, wrong frames.

    ``request_id`` is set when the message's request could still be identified, so the
    receiver can answer that request with an error output instead of dropping it.
    """

    def __init__(self, message: str, *, msg_type: bytes | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(message)
        self.msg_type = msg_type
        self.request_id = request_id


class RequestExecutionError(EngineError):
    """A fault inside a step that is pinned to some requests: those fail, the engine goes on.
    ``request_fault``: the requests asked for something impossible (their error is an
    invalid-request one, a 400), not an engine fault."""

    def __init__(self, request_ids: list[str], message: str, request_fault: bool = False) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)
        self.request_fault = request_fault


class GrammarError(InvalidRequestError):
    """A structured-output spec (JSON schema, regex, grammar) does not compile, or a replay
    prefix does not match it; only that request fails."""


class WeightLoadError(EngineError):
    """New weights could not be loaded (missing files, another architecture or shape);
    the engine keeps serving the weights it has."""


class WeightLoadInProgressError(WeightLoadError):
    """New weights were asked for while another load is still reading or waiting to swap."""
