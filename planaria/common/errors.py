"""Errors of the admin protocol (planaria.common).

``AdminError(code, reason)`` and its subclasses are the errors an admin command may raise;
each subclass stands for one ``ErrorCode``. The other errors are a client's: the call got no
valid reply (``NotRunningError``, ``AuthRefusedError``, ``MalformedReplyError``).

``to_reply`` is the one place where exceptions become wire replies, and ``from_reply`` the
one place where wire replies become exceptions again on the client side. Keep causes:
``raise ... from exc``.
"""

from __future__ import annotations

import msgspec

from planaria.common.envelope import Err, ErrorCode


class CommonError(Exception):
    """Base class for every error of the common package."""


class AdminError(CommonError):
    """An admin request failed with ``code``; ``reason`` is for the operator."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        self.code = ErrorCode(code)
        self.reason = reason
        super().__init__(reason)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.value}, {self.reason!r})"


class _CodedAdminError(AdminError):
    CODE: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, reason: str) -> None:
        super().__init__(self.CODE, reason)


class UnknownCommandError(_CodedAdminError):
    CODE = ErrorCode.UNKNOWN_COMMAND


class BadArgumentError(_CodedAdminError):
    CODE = ErrorCode.BAD_ARGUMENT


class UnknownEngineError(_CodedAdminError):
    CODE = ErrorCode.UNKNOWN_ENGINE


class ConflictError(_CodedAdminError):
    CODE = ErrorCode.CONFLICT


class UnavailableError(_CodedAdminError):
    CODE = ErrorCode.UNAVAILABLE


class InternalError(_CodedAdminError):
    CODE = ErrorCode.INTERNAL


_BY_CODE: dict[ErrorCode, type[_CodedAdminError]] = {
    cls.CODE: cls for cls in (UnknownCommandError, BadArgumentError, UnknownEngineError,
                              ConflictError, UnavailableError, InternalError)
}


class NotRunningError(CommonError):
    """Nobody answers on the admin socket: no socket file, no answer within the timeout,
    or (TCP) no connection accepted. The daemon or frontend is not running, or is stuck."""


class AuthRefusedError(CommonError):
    """A TCP admin socket refused this client's CurveZMQ keys, or the handshake failed."""


class MalformedReplyError(CommonError):
    """An admin socket's peer answered something that is not a valid reply envelope."""


def to_reply(request_id: str, exc: BaseException) -> Err:
    """The reply for a request that raised ``exc``.

    ``AdminError`` keeps its code; a peer admin socket that is absent, silent or garbled
    (``NotRunningError``, ``MalformedReplyError``: the daemon asked its frontend, which is not
    there) is ``UNAVAILABLE``; ``msgspec.ValidationError`` (arguments that do not fit a
    command's request struct) is ``BAD_ARGUMENT``; anything else is ``INTERNAL``, with the
    exception type in the reason (the server logs the traceback).
    """
    if isinstance(exc, AdminError):
        return Err(request_id, exc.code, exc.reason)
    if isinstance(exc, (NotRunningError, MalformedReplyError)):
        return Err(request_id, ErrorCode.UNAVAILABLE, str(exc))
    if isinstance(exc, msgspec.ValidationError):
        return Err(request_id, ErrorCode.BAD_ARGUMENT, f"invalid arguments: {exc}")
    return Err(request_id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def from_reply(err: Err) -> AdminError:
    """The exception a client raises for an ``Err`` reply."""
    cls = _BY_CODE.get(err.code)
    return cls(err.reason) if cls else AdminError(err.code, err.reason)
