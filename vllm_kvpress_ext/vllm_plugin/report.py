"""What the worker tells the scheduler after each step (carried on `ModelRunnerOutput.kvpress`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_kvpress_ext.engine.layerwise import prefill_reservation
from vllm_kvpress_ext.engine.prefix_store import CachedPrefix, StoreView
from vllm_kvpress_ext.engine.stats import PrefixStoreStats
from vllm_kvpress_ext.policies import KVPolicy


@dataclass
class PoolReport:
    """The real per-(layer, KV head) pool after a step, and the KV figures of the requests it touched.

    `decode_pages[r]` is exactly what request r's next token will allocate (heads are ragged after
    compression, so it varies per request); a request absent from it is still prefilling and was
    reserved its prefill peak when it started (`prefill_pages`). `pages_per_token_block` is layers x KV
    heads: one page per (layer, head) for every `page_size` uncompressed tokens.
    """

    pages_total: int
    pages_free: int
    page_size: int
    pages_per_token_block: int
    page_bytes: int
    pages_held: dict[str, int] = field(default_factory=dict)
    decode_pages: dict[str, int] = field(default_factory=dict)
    kv: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    num_layers: int = 0  # layers x KV heads = pages_per_token_block; 0 where a report does not say
    num_kv_heads: int = 0
    # Whether a policy that compresses layer by layer does so during a whole-prompt prefill here; where it does
    # not (a model with sliding-window layers), the full prompt is reserved.
    compresses_layerwise: bool = True
    # The worker's compressed prefix store (prefix caching on): its model key (the namespace of every entry),
    # every stored key, the entries stored since the last report (no rows or policy state: what matching
    # needs), the pages dropping every unused entry would free, and for each running request its
    # compression boundary and tokens written (what it leaves as a session entry if it finishes now).
    prefix_model: str = ""
    prefix_matching: str = "auto"  # the store's matching mode, which the scheduler's mirror must share
    prefix_keys: list[str] = field(default_factory=list)
    prefix_added: list[CachedPrefix] = field(default_factory=list)
    prefix_evictable: int = 0
    prefix_sessions: dict[str, tuple[int, int]] = field(default_factory=dict)
    prefix_stats: PrefixStoreStats | None = None  # the store's cumulative hits and what it holds (metrics)
    # On vLLM's runner with vLLM's prefix caching: the vLLM block ids whose pages the pool keeps, when they
    # changed since the last report (None: unchanged). The scheduler caps vLLM's prefix hits at them.
    prefix_blocks: frozenset[int] | None = None

    def add_store(self, view: StoreView) -> None:
        """A store of compressed prefixes or contexts, as the scheduler's mirror of it needs it (`PrefixStore.view`);
        the pages dropping its unused entries would free add to those of any other store reported."""
        self.prefix_model, self.prefix_matching = view.model_dir, view.matching
        self.prefix_keys, self.prefix_added = view.keys, view.added
        self.prefix_evictable += view.evictable_pages
        self.prefix_stats = view.stats

    def full_prompt_pages(self, num_tokens: int) -> int:
        """Pages a request needs to prefill `num_tokens` tokens uncompressed."""
        return self.pages_per_token_block * -(-num_tokens // self.page_size)

    def prefill_pages(
        self, num_tokens: int, policy: KVPolicy | None, whole_prompt: bool, chunk_tokens: int | None = None
    ) -> int:
        """Pages to reserve for a prefill of `num_tokens` tokens under `policy`: the embedded scheduler's rule.

        The uncompressed peak, or the policy's declared peak when the prefill compresses layer by layer in
        one chunk (`whole_prompt`; the worker's runner fails a request that needs more, alone), or, for an
        admission policy whose chunks are at most `chunk_tokens` tokens, its chunked prefill peak.
        """
        if not self.num_layers or not self.num_kv_heads:
            return self.full_prompt_pages(num_tokens)
        whole_prompt = whole_prompt and self.compresses_layerwise
        return prefill_reservation(
            policy,
            num_tokens,
            whole_prompt,
            self.num_layers,
            self.num_kv_heads,
            self.page_size,
            chunk_tokens=chunk_tokens,
        )
