"""Errors of the frontend package. Each becomes an OpenAI-style error body in exactly one
place (``frontend.server.FrontendServer._errors_middleware``), with the status and the
headers (``Retry-After``, ``WWW-Authenticate``, ``Connection: close``) the class names."""

from __future__ import annotations


class FrontendError(Exception):
    """Base class for every frontend error; carries the HTTP status and OpenAI error fields."""

    status = 500
    type = "internal_server_error"
    close_connection = False  # answer with Connection: close (the body may be half read)
    hang_up = False  # and close the socket right after the reply, reading nothing more

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"} if self.close_connection else {}


class RequestError(FrontendError):
    """The request body is invalid: HTTP 400, nothing was sent to an engine."""

    status = 400
    type = "invalid_request_error"


class AuthenticationError(FrontendError):
    """No or a wrong ``Authorization: Bearer`` key: HTTP 401, as OpenAI answers it."""

    status = 401
    type = "invalid_request_error"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class NotFoundError(FrontendError):
    """Unknown model name: HTTP 404, as OpenAI answers it."""

    status = 404
    type = "invalid_request_error"


class BodyTimeoutError(FrontendError):
    """The body did not arrive within the body-read timeout (a slow or stalled client): 408,
    and the connection is closed (what is left of the body is never read)."""

    status = 408
    type = "invalid_request_error"
    close_connection = True
    hang_up = True


class BodyTooLargeError(FrontendError):
    """The body is over ``--max-body-bytes``: 413, connection closed (aiohttp first reads
    and drops what the client is still sending, for at most its lingering time, so that the
    client can read the reply)."""

    status = 413
    type = "invalid_request_error"
    close_connection = True


class TooManyRequestsError(FrontendError):
    """The frontend or an engine is full: HTTP 429 with ``Retry-After``; retrying later helps."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: int = 1, code: str | None = "overloaded") -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ServiceUnavailableError(FrontendError):
    """No engine can serve the request now (none ready, or it died under the request), or
    the prompt could not be rendered in time (``render_timeout``)."""

    status = 503
    type = "service_unavailable_error"


class GatewayTimeoutError(FrontendError):
    """The request ran past ``--request-timeout-s``; it was aborted in its engine."""

    status = 504
    type = "timeout_error"


class EngineRequestError(FrontendError):
    """The engine finished the request with an error after accepting it."""

    status = 500
    type = "internal_server_error"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
