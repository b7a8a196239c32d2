"""`kvpress serve`: build the engine from a `ServerConfig`, then run uvicorn on the app.

Shutdown (SIGTERM, or SIGINT once) drains: the listening socket closes, new requests get 503,
requests in flight run on for `shutdown_grace` seconds, and whatever is still running then ends with
the documented shutdown error (503, or an error event and `[DONE]` on a stream) instead of a cut
connection. The process then exits 0. A second SIGINT forces the exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
from types import FrameType
from typing import Any

import uvicorn

from vllm_kvpress_ext.engine import LLMEngine
from vllm_kvpress_ext.server.config import ServerConfig
from vllm_kvpress_ext.server.engine_loop import EngineLoop

logger = logging.getLogger(__name__)


def build_engine(config: ServerConfig) -> LLMEngine:
    return LLMEngine(
        config.model_dir,
        dtype=config.dtype,
        device=config.device,
        num_pages=config.num_pages,
        kv_memory=config.kv_memory,
        page_size=config.page_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        kv_policy=config.kv_policy,
        enable_prefix_caching=config.enable_prefix_caching,
        max_cached_prefixes=config.max_cached_prefixes,
        prefix_matching=config.prefix_matching,
    )


def engine_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that builds the engine and then runs its loop (`create_app(..., engine_thread)`).

    libgomp keeps a team of OpenMP threads for every thread that has run a parallel region, and once
    its threads outnumber the cores it stops spinning between regions: each of the hundreds of torch
    ops of a step then wakes sleeping threads. Built on the main thread and stepped on the loop's, the
    engine had two teams; measured on the 2-core development machine, a closed loop of 32 requests
    (542 prompt and 64 output tokens, 16 at a time) in process took 27.5 s that way and 22.9 to 24.3 s
    built and stepped on one thread, the served load in docs/server.md the same.
    """
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpress-engine")


class DrainingServer(uvicorn.Server):
    """uvicorn whose shutdown lets the engine loop's requests finish within `grace` seconds."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, grace: float) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop
        self.grace = grace

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal once it has shut down, which ends the process with the
        # signal's status; a drained shutdown is a normal exit (status 0).
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.engine_loop.drain()
        # At the deadline the loop stops: each request still running gets the shutdown failure, its
        # handler answers it, and the connection closes normally. `stop` joins a thread: not on the loop.
        deadline = asyncio.get_running_loop().call_later(
            self.grace, lambda: threading.Thread(target=self.engine_loop.stop, daemon=True).start()
        )
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()


def draining_server(app: Any, config: ServerConfig, **uvicorn_settings: Any) -> DrainingServer:
    """A `DrainingServer` for an app from `create_app`; uvicorn's own cut-off comes well after the grace."""
    settings = {"host": config.host, "port": config.port, "log_level": config.log_level, **uvicorn_settings}
    uv_config = uvicorn.Config(app, timeout_graceful_shutdown=int(config.shutdown_grace) + 10, **settings)
    return DrainingServer(uv_config, app.state.kvpress.loop, config.shutdown_grace)


def serve(config: ServerConfig) -> None:
    """Load the model, then serve until SIGTERM/SIGINT, draining in-flight requests (module docstring)."""
    from vllm_kvpress_ext.server.app import create_app

    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    thread = engine_thread()
    engine = thread.submit(build_engine, config).result()
    pool = engine.stats()
    c = engine.config
    print(
        f"kvpress serve: model {config.model_name!r} from {config.model_dir} ({c.num_hidden_layers} layers, "
        f"{c.num_key_value_heads} KV heads, max_model_len {engine.max_model_len}); KV pool {pool.pages_total} pages x "
        f"{pool.page_bytes} B = {pool.pages_total * pool.page_bytes / 2**20:.1f} MiB; default policy "
        f"{engine.default_policy.name if engine.default_policy else 'full'}; http://{config.host}:{config.port}",
        flush=True,
    )
    app = create_app(config, engine, thread)
    try:
        draining_server(app, config).run()
    finally:
        thread.shutdown(wait=False)
