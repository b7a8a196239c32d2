"""What the worker tells the scheduler after each step (carried on `ModelRunnerOutput.kvpress`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PoolReport:
    """The real per-(layer, KV head) pool after a step, and the KV figures of the requests it touched.

    `decode_pages[r]` is exactly what request r's next token will allocate (heads are ragged after
    compression, so it varies per request); a request absent from it is still prefilling and was
    reserved its uncompressed peak at admission. `pages_per_token_block` is layers x KV heads: one
    page per (layer, head) for every `page_size` uncompressed tokens.
    """

    pages_total: int
    pages_free: int
    page_size: int
    pages_per_token_block: int
    page_bytes: int
    held: dict[str, int] = field(default_factory=dict)
    decode_pages: dict[str, int] = field(default_factory=dict)
    kv: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    def peak_pages(self, num_tokens: int) -> int:
        """Pages a request needs to prefill `num_tokens` tokens uncompressed."""
        return self.pages_per_token_block * -(-num_tokens // self.page_size)
