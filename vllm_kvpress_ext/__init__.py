"""vllm-kvpress-ext: per-head KV-cache compression that physically frees paged memory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_kvpress_ext.version import __version__

if TYPE_CHECKING:
    from vllm_kvpress_ext.engine import LLM, ContextQuestion, SamplingParams

__all__ = ["LLM", "ContextQuestion", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import vllm_kvpress_ext` (and `kvpress --help`) does not pay for torch.
    if name in ("LLM", "ContextQuestion", "SamplingParams"):
        from vllm_kvpress_ext import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'vllm_kvpress_ext' has no attribute {name!r}")
