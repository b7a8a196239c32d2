"""OpenAI-shaped errors, `{"error": {"message", "type", "param", "code"}}`, for both servers.

OpenAI clients (the official SDK included) read `error.message` to build their exceptions, so every
failure either server reports -- the embedded server's handlers, the vLLM plugin's request checks --
is an `APIError` rendered by `error_body`. Nothing here depends on a web framework.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A failure with an HTTP status and OpenAI's error fields; raised anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str) -> APIError:
    """A parameter OpenAI defines that this server deliberately does not implement."""
    return APIError(400, f"{param}: {what}", param=param, code="unsupported_parameter")
