"""Errors in vLLM's OpenAI-compatible shape, `{"error": {"message", "type", "param", "code"}}`, for both servers.

OpenAI clients (the official SDK included) read `error.message` and the HTTP status to build their
exceptions. Both servers fill the other fields as vLLM's server does (`vllm/entrypoints/serve/exception_handling`):
`code` is the status, `type` vLLM's name for it (`BadRequestError`, `NotFoundError`, ...), so a client sees the
same body from `kvpress serve` as from `vllm serve` with the plugin. Every failure either server reports -- the
embedded server's handlers, the plugin's request checks -- is an `APIError` rendered by `error_body`. Nothing
here depends on a web framework.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

#: vLLM's `type` for the statuses its own handlers raise; any other status takes its HTTP phrase, as vLLM's
#: framework-level errors do.
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or HTTPStatus(status).phrase


class APIError(Exception):
    """A failure with an HTTP status and the parameter it concerns; raised anywhere in a handler."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, status=self.status, param=self.param)


def error_body(message: str, *, status: int = 400, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


def bad_request(message: str, *, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unsupported(param: str, what: str) -> APIError:
    """A parameter OpenAI defines that this server deliberately does not implement."""
    return APIError(400, f"{param}: {what}", param=param)
