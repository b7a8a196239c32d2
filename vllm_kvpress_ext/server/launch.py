"""`kvpress serve`: build the engine from a `ServerConfig`, then run uvicorn on the app."""

from __future__ import annotations

import logging

from vllm_kvpress_ext.engine import LLMEngine
from vllm_kvpress_ext.server.config import ServerConfig

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
    )


def serve(config: ServerConfig) -> None:
    """Load the model, then serve until interrupted (uvicorn handles SIGINT/SIGTERM)."""
    import uvicorn

    from vllm_kvpress_ext.server.app import create_app

    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = build_engine(config)
    pool = engine.cache.pool
    c = engine.config
    print(
        f"kvpress serve: model {config.model_name!r} from {config.model_dir} ({c.num_hidden_layers} layers, "
        f"{c.num_key_value_heads} KV heads, max_model_len {engine.max_model_len}); KV pool {pool.num_pages} pages x "
        f"{pool.bytes_per_page} B = {pool.num_pages * pool.bytes_per_page / 2**20:.1f} MiB; default policy "
        f"{engine.default_policy.name if engine.default_policy else 'full'}; http://{config.host}:{config.port}",
        flush=True,
    )
    app = create_app(config, engine)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, timeout_graceful_shutdown=5)
