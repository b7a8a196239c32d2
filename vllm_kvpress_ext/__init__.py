"""vllm-kvpress-ext: per-head KV-cache compression that physically frees paged memory."""

__version__ = "0.1.0"

__all__ = ["__version__"]
