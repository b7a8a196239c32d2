"""`create_app`: the FastAPI application around one engine and its loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from vllm_kvpress_ext.engine import LLMEngine
from vllm_kvpress_ext.server.config import ServerConfig
from vllm_kvpress_ext.server.engine_loop import EngineLoop
from vllm_kvpress_ext.server.errors import install_error_handlers
from vllm_kvpress_ext.server.guards import BodySizeLimit
from vllm_kvpress_ext.server.metrics import ServerMetrics
from vllm_kvpress_ext.server.openapi import install_openapi
from vllm_kvpress_ext.server.routes import router
from vllm_kvpress_ext.server.serving import ServerState
from vllm_kvpress_ext.version import __version__


def create_app(
    config: ServerConfig, engine: LLMEngine, engine_thread: concurrent.futures.ThreadPoolExecutor | None = None
) -> FastAPI:
    """An app serving `engine`. The engine loop starts with the app's lifespan and stops with it.

    The engine is built by the caller (`build_engine`) so that model-loading errors surface before
    a port is bound, and so tests can keep a handle on it. `engine_thread`: the thread that built it,
    for the loop to run on (`launch.engine_thread`); a thread of the loop's own otherwise.
    """
    metrics = ServerMetrics()
    loop = EngineLoop(engine, metrics, max_queue=config.max_queue)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        loop.start(engine_thread)
        try:
            yield
        finally:
            # Joining blocks; off the event loop so the thread's last posts can still be delivered.
            await asyncio.to_thread(loop.stop)

    app = FastAPI(
        title="kvpress",
        version=__version__,
        description="OpenAI-compatible server on the kvpress engine: per-request KV compression that frees pages.",
        lifespan=lifespan,
    )
    app.state.kvpress = ServerState(config=config, engine=engine, loop=loop, metrics=metrics)
    install_error_handlers(app, on_rejected=lambda: metrics.requests.labels(status="rejected").inc())
    app.include_router(router)
    install_openapi(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)
    return app
