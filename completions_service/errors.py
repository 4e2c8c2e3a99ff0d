"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` and a status.

Every refusal the service makes is an :class:`ApiError`; its message says what is wrong and,
where the caller can do something, what to do.
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An HTTP error answer. ``param`` names the request field at fault, when one is."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        #: Seconds a client should wait before trying again (the ``Retry-After`` header).
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


class InvalidRequest(ApiError):
    """400: a field's value is wrong, or asks for what the model cannot do."""


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(ApiError):
    status = 404
    code = "model_not_found"


class BodyTooLarge(ApiError):
    status = 413
    code = "request_too_large"


class QueueFull(ApiError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class Unavailable(ApiError):
    """503: Triton is unreachable, or its model is not ready."""

    status = 503
    type = "server_error"
    code = "backend_unavailable"


class Timeout(ApiError):
    status = 504
    type = "server_error"
    code = "timeout"


class BackendError(ApiError):
    """500: Triton answered with an error that is not the request's fault."""

    status = 500
    type = "server_error"
    code = "backend_error"
