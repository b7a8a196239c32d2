"""OpenAI-compatible HTTP server driving the embedded engine (`kvpress serve`).

Modules, one job each: `config` (settings, size parsing), `protocol` (request schemas), `errors`
(OpenAI-shaped errors), `policy` (per-request KV policy), `engine_loop` (the thread that owns the
engine), `metrics` (Prometheus), `streaming` (SSE), `serving` / `completions` / `chat` (handlers),
`routes`, `app` (`create_app`) and `launch` (`build_engine`, `serve`).

Nothing heavy is imported here, so `kvpress --help` stays instant.
"""

from vllm_kvpress_ext.server.config import ServerConfig

__all__ = ["ServerConfig"]
