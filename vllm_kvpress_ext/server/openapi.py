"""What `/openapi.json` says the server answers: every status it sends, and the non-JSON bodies.

FastAPI documents 200 and 422 by default. This server answers schema violations with 400 (never
422), and also sends 404, 413, 429, 500 and 503, each with OpenAI's error body; completions stream
as server-sent events and `/metrics` is Prometheus text. `install_openapi` removes the 422s that
FastAPI adds on its own.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body as vLLM fills it (`code` the status), sent with every non-2xx status."""

    error: ErrorDetail


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion as JSON; with `stream: true`, server-sent events "
        "(`data: {chunk}` lines, an error event if the engine fails, then `data: [DONE]`)",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    400: _error("Invalid request: schema violation, unsupported parameter, bad prompt or kv_policy"),
    404: _error("`model` names a model this server does not serve"),
    413: _error("The request body exceeds the server's size limit"),
    429: _error("The waiting queue is full; retry later"),
    500: _error("The engine failed while running this request (it alone was aborted)"),
    503: _error("The engine loop is not running, or the server is shutting down"),
}

HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {503: _error("The engine loop is not running")}


def install_openapi(app: FastAPI) -> None:
    """Serve a schema without FastAPI's automatic 422 responses (this server answers 400 instead)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
