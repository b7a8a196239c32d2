"""Errors in vLLM's OpenAI-compatible shape (`api/errors.py`): `{"error": {"message", "type", "param", "code"}}`.

OpenAI clients (the official SDK included) read `error.message` to build their exceptions, so
every path out of the server that is not a success -- our own checks, FastAPI's schema
validation, unknown routes, unexpected exceptions -- goes through the same shape.

Schema violations and malformed JSON are answered with **400** (not FastAPI's default 422),
like OpenAI's API and vLLM, so clients need only one rule for "my request was wrong".
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_kvpress_ext.api.errors import APIError, error_body

logger = logging.getLogger(__name__)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending parameter, from pydantic's error list."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    parts: list[str] = []
    first_param: str | None = None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            parts.append(f"malformed JSON body: {ctx.get('error', err.get('msg', 'invalid JSON'))}")
            continue  # its location is a character offset, not a parameter
        if err.get("type") == "unknown_kv_field":  # protocol._SamplingFields: names the field itself
            first_param = first_param or (err.get("ctx") or {}).get("name")
            parts.append(str(err.get("msg")))
            continue
        first_param = first_param or param
        if param is None and err.get("type") != "missing":
            parts.append("the request body must be a JSON object")
        elif err.get("type") == "extra_forbidden":
            parts.append(f"unrecognized request argument supplied: {param}")
        elif err.get("type") == "missing" and param is None:
            parts.append("the request needs a JSON body")
        else:
            parts.append(f"{param}: {err.get('msg', 'invalid value')}" if param else str(err.get("msg")))
    return "; ".join(parts), first_param


def install_error_handlers(app: FastAPI, on_rejected: Any = None) -> None:
    """Route every error through `error_body`; `on_rejected()` is called for each 4xx (metrics)."""

    def rejected() -> None:
        if on_rejected is not None:
            on_rejected()

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        if 400 <= exc.status < 500 and exc.status != 429:
            rejected()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        rejected()
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # exc.headers carries e.g. the `Allow` header of a 405.
        return JSONResponse(
            error_body(str(exc.detail), status=exc.status_code), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        # The type only: an exception's text may quote data (a file, a prompt) that is not the client's.
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", status=500), status_code=500)
