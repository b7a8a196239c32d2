"""The HTTP routes. Thin: each one delegates to the module that does its job."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from vllm_kvpress_ext.api.errors import error_body
from vllm_kvpress_ext.policies import policy_names
from vllm_kvpress_ext.server.chat import create_chat_completion
from vllm_kvpress_ext.server.completions import create_completion
from vllm_kvpress_ext.server.guards import GuardedRoute
from vllm_kvpress_ext.server.openapi import GENERATION_RESPONSES, HEALTH_RESPONSES
from vllm_kvpress_ext.server.serving import ServerState

router = APIRouter(route_class=GuardedRoute)
router.add_api_route(
    "/v1/completions", create_completion, methods=["POST"], summary="Text completion", responses=GENERATION_RESPONSES
)
router.add_api_route(
    "/v1/chat/completions",
    create_chat_completion,
    methods=["POST"],
    summary="Chat completion",
    responses=GENERATION_RESPONSES,
)


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.kvpress
    return state


@router.get("/health", summary="200 while the engine loop runs, 503 otherwise", responses=HEALTH_RESPONSES)
async def health(request: Request) -> Response:
    if not _state(request).loop.alive:
        return JSONResponse(error_body("the engine loop is not running", status=503), status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/v1/models", summary="The one served model")
async def list_models(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "kvpress",
                "root": str(state.config.model_dir),
                "max_model_len": state.max_model_len,
            }
        ],
    }


@router.get("/metrics", summary="Prometheus metrics (kvpress_*)", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/debug/kv", summary="KV pool and queue as the engine loop last saw them")
async def debug_kv(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {
        **asdict(state.loop.snapshot),
        "default_policy": state.loop.default_policy,
        "policies": policy_names(),
        "max_queue": state.loop.max_queue,
        "max_model_len": state.max_model_len,
    }
