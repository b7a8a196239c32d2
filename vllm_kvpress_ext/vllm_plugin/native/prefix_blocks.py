"""`PrefixBlocks`: the pool's side of vLLM's automatic prefix caching on vLLM's runner.

vLLM's scheduler hashes every full block of tokens it schedules and, for a new request, finds the
longest run of leading blocks already computed (`KVCacheManager.get_computed_blocks`); it then
schedules only the rest of the prompt. vLLM's block manager is bookkeeping only on this path, so the
keys and values of those blocks must be here: for each vLLM block id, the one page per (layer, KV
head) that holds its tokens, `page_size` (= vLLM's block size) of them.

A block is kept when it is full in an *aligned* row: a request without a policy, whose page `b` in
every global (layer, KV head) holds exactly tokens `[b * page_size, (b + 1) * page_size)`. A
sliding-window layer is a ring whose pages are soon overwritten, so an aligned row also writes each
block's tokens in those layers to pages of the block's own (`NativePool`'s spill pages), which the kept
block takes. So every kept block is what a run without the cache computes for those tokens, and a
request that reads it gets the outputs of a run without the cache; its rings are rebuilt from the last
window's blocks (`PagedKVCache.add_request_on_pages`). Keeping a block shares its pages (a reference
each); a row that later writes into a shared page copies it first, so kept pages never change.
A compressing request is aligned too until its policy compresses: its prompt's full blocks are kept just
before, and it reads kept blocks up to the first position its policy needs its own prefill to compute
(`readable_prefix`: the observation window's start, 0 for statistics over every prompt token). Its
compaction then copies the kept pages it moves entries into (copy-on-write), the kept blocks stay exact,
and its outputs are those of a run without the cache whose prefill is cut into chunks at the same token.
A policy that compresses layer by layer (inside the forward pass, before blocks could be kept) or gates
writes during the prefill (WG-KV) neither keeps nor reads blocks.

A kept block is dropped when vLLM hands its id to new tokens (its hash is gone from vLLM's table
then), and, least recently used first, when the pool needs its pages. The scheduler caps vLLM's hits at
the blocks this reports as kept (`PoolReport.prefix_blocks`), so vLLM never promises a block that is
not here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch

from vllm_kvpress_ext.cache import PagedKVCache
from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.policies.base import AdmissionPolicy


def keeps_prompt_blocks(policy: KVPolicy | None) -> bool:
    """Whether a request's row stays aligned (page b holds block b's tokens) until its policy compresses, so its
    prompt's full blocks can be kept: not where the policy compacts inside the pass or gates writes."""
    return policy is None or not (policy.compresses_layerwise or isinstance(policy, AdmissionPolicy))


def readable_prefix(policy: KVPolicy | None, prompt_len: int) -> int:
    """Leading prompt tokens a request may read from kept blocks (and whose blocks it keeps, as it writes them
    uncompressed): all of them without a policy; for a compressing policy, those before the first position
    whose prefill it reads (`KVPolicy.reusable_prefix`), none where it compresses layer by layer or gates
    writes."""
    if policy is None:
        return prompt_len
    return policy.reusable_prefix(prompt_len) if keeps_prompt_blocks(policy) else 0


class PrefixBlocks:
    """vLLM block id -> its pages `[L, H]`, least recently used first."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.kept: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._changed = True
        self._all_pages: torch.Tensor | None = (
            None  # every kept page, flat; rebuilt after a change (each report reads it)
        )

    def keep(self, block_id: int, pages: torch.Tensor) -> None:
        """Keep a full block's pages `[L, H]` (one more reference each) under `block_id`."""
        if block_id in self.kept:
            self.kept.move_to_end(block_id)
            return
        pages = pages.to(torch.int64).clone()
        self.cache.pool.share(pages.reshape(-1))
        self.kept[block_id] = pages
        self._changed, self._all_pages = True, None

    def forget(self, block_ids: Iterable[int]) -> None:
        """Drop the blocks (those kept) whose ids vLLM has given to other tokens."""
        for block_id in block_ids:
            pages = self.kept.pop(block_id, None)
            if pages is not None:
                self.cache.pool.free(pages.reshape(-1))
                self._changed, self._all_pages = True, None

    def holds(self, block_ids: list[int]) -> bool:
        return all(block_id in self.kept for block_id in block_ids)

    def pages_of(self, block_ids: list[int]) -> torch.Tensor:
        """The pages `[L, H, k]` of kept blocks, in order; each becomes the most recently used."""
        for block_id in block_ids:
            self.kept.move_to_end(block_id)
        return torch.stack([self.kept[block_id] for block_id in block_ids], dim=-1)

    def drop_oldest(self) -> bool:
        """Drop the least recently used kept block; False when none is kept."""
        if not self.kept:
            return False
        self.forget([next(iter(self.kept))])
        return True

    def free_up(self, pages: int) -> bool:
        """Drop kept blocks, least recently used first, until `pages` pages are free; whether they are."""
        pool = self.cache.pool
        while pool.num_free < pages and self.kept:
            self.forget([next(iter(self.kept))])
        return pool.num_free >= pages

    def evictable_pages(self) -> int:
        """Pages that dropping every kept block would free (those no row reads)."""
        if not self.kept:
            return 0
        if self._all_pages is None:
            self._all_pages = torch.cat([pages.reshape(-1) for pages in self.kept.values()])
        return int((self.cache.pool.refcounts(self._all_pages) == 1).sum())

    def changes(self) -> frozenset[int] | None:
        """The kept block ids, if they changed since the last call (None: unchanged)."""
        if not self._changed:
            return None
        self._changed = False
        return frozenset(self.kept)
