"""Errors of the frontend package. Each becomes an OpenAI-style error body in exactly one
place (``frontend.server._error_response``)."""

from __future__ import annotations


class FrontendError(Exception):
    """Base class for every frontend error; carries the HTTP status and OpenAI error fields."""

    status = 500
    type = "internal_server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


class RequestError(FrontendError):
    """The request body is invalid: HTTP 400, nothing was sent to an engine."""

    status = 400
    type = "invalid_request_error"


class NotFoundError(FrontendError):
    """Unknown model name: HTTP 404, as OpenAI answers it."""

    status = 404
    type = "invalid_request_error"


class ServiceUnavailableError(FrontendError):
    """No engine can serve the request now (none ready, or it died under the request)."""

    status = 503
    type = "service_unavailable_error"


class EngineRequestError(FrontendError):
    """The engine finished the request with an error after accepting it."""

    status = 500
    type = "internal_server_error"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
