"""Compressed prefixes kept in the pool for later requests to attach to (compressed prefix reuse).

A request with a context/question boundary (`compress_after` = c, fewer than its prompt tokens: a
`ContextQuestion` offline, `kv_prefix_tokens` over HTTP) has its policy compress the first c tokens
question-agnostically, then reads the rest from the compressed cache. Once it has compressed, the
store forks its row into a row of its own (pages shared, nothing copied) under a content key: the
model, the policy with every hyperparameter (its dataclass repr) and the c token ids. A later
request with the same key does not prefill: it forks the stored row (read-only pages; its own
tokens go to its own pages, copy-on-write at the shared partial last page) with a copy of the
policy state, and continues from token c exactly as the first request did right after compressing,
so it produces the tokens it would produce from the same compressed cache built fresh.

Memory stays the scheduler's: entries are dropped least recently used first (their references
released) before any running request is preempted and before a waiting prefill is refused; an
entry that a running request attached to is never dropped. Not cached: requests whose policy gates
writes during prefill (WG-KV: its ring and admission flags are sized per request), and attaching
is skipped for requests that ask for prompt log-probabilities (those come from the prefill).
"""

from __future__ import annotations

import copy
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kvpress_ext.cache import PagedKVCache, RequestCapacityError
from vllm_kvpress_ext.engine.request import KVStats, Request


@dataclass
class CachedPrefix:
    key: str
    row_id: str  # the store's own row in the cache
    length: int
    policy_state: Any
    kv: KVStats
    users: int = 0  # running requests attached to it


def prefix_key(model_dir: str | Path, policy: Any, token_ids: list[int]) -> str:
    """Content key of a compressed prefix: the model, the policy with all its parameters, the tokens."""
    digest = hashlib.sha256()
    digest.update(str(model_dir).encode())
    digest.update(b"\0" + repr(policy).encode() + b"\0")
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.hexdigest()


class PrefixStore:
    """Up to `capacity` compressed prefixes, each held by a cache row of its own, in LRU order."""

    def __init__(self, cache: PagedKVCache, model_dir: str | Path, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the prefix store needs a capacity >= 1, got {capacity}")
        self.cache = cache
        self.model_dir = str(model_dir)
        self.capacity = capacity
        self.entries: OrderedDict[str, CachedPrefix] = OrderedDict()
        self.hits = 0
        self.tokens_reused = 0
        self.stored = 0
        self.evicted = 0

    @staticmethod
    def boundary(request: Request) -> int | None:
        """The prefix length a request could share, or None when it has no cacheable boundary."""
        c = request.compress_after
        if request.policy is None or request.admission is not None or c is None:
            return None
        return c if c < len(request.prompt_token_ids) else None

    def key_of(self, request: Request) -> str | None:
        c = self.boundary(request)
        if c is None:
            return None
        return prefix_key(self.model_dir, request.policy, request.prompt_token_ids[:c])

    def store(self, request: Request) -> None:
        """Keep the prefix `request` has just compressed (its first `compress_after` tokens), if cacheable."""
        key = self.key_of(request)
        if key is None or key in self.entries or request.num_processed != request.compress_after:
            return
        if len(self.entries) >= self.capacity and self.evict_one() is None:
            return
        row_id = f"prefix:{key}"
        try:
            self.cache.fork_request(request.request_id, row_id)
        except RequestCapacityError:
            return
        self.entries[key] = CachedPrefix(
            key, row_id, request.num_processed, copy.deepcopy(request.policy_state), copy.deepcopy(request.kv)
        )
        self.stored += 1

    def attach(self, request: Request) -> bool:
        """Start `request` from a stored prefix if there is one for it; True if it was attached.

        On success the request holds a forked row with the prefix, `num_processed` = its length, and
        the policy state it had right after compressing; the caller marks it running.
        """
        if request.params.prompt_logprobs is not None:
            return False
        key = self.key_of(request)
        entry = self.entries.get(key) if key is not None else None
        if entry is None:
            return False
        try:
            request.row = self.cache.fork_request(entry.row_id, request.request_id)
        except RequestCapacityError:
            return False
        self.entries.move_to_end(entry.key)
        entry.users += 1
        request.prefix_key = entry.key
        request.num_processed = entry.length
        request.cached_tokens = entry.length
        request.policy_state = copy.deepcopy(entry.policy_state)
        request.kv = copy.deepcopy(entry.kv)
        request.kv.prompt_tokens = len(request.prompt_token_ids)
        self.hits += 1
        self.tokens_reused += entry.length
        return True

    def detach(self, request: Request) -> None:
        """The request no longer holds its row (finished, aborted or preempted)."""
        entry = self.entries.get(request.prefix_key) if request.prefix_key is not None else None
        if entry is not None:
            entry.users -= 1
        request.prefix_key = None

    def evict_one(self) -> int | None:
        """Drop the least recently used entry no running request is attached to.

        Returns the pages that went back to the free list (0 when all its pages are still referenced
        elsewhere), or None when every entry is in use (or there is none).
        """
        for key, entry in self.entries.items():
            if entry.users == 0:
                before = self.cache.pool.num_free
                self.cache.free_request(entry.row_id)
                del self.entries[key]
                self.evicted += 1
                return self.cache.pool.num_free - before
        return None

    def clear(self) -> None:
        while self.entries and self.evict_one() is not None:
            pass

    def pages_held(self) -> int:
        """Pages the stored prefixes reference (a page shared with a running request counts too)."""
        return sum(self.cache.usage(entry.row_id).pages for entry in self.entries.values())
