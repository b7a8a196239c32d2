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

Uncompressed caches, in every matching mode: a request without a policy (`full`) leaves its row, when it
finishes normally, as a session entry usable from position 0 (boundary 0: nothing was compressed, so any
prefix of it is exact). A later request without a policy whose prompt shares a page or more of its tokens
attaches at the longest common prefix and prefills only the rest, as vLLM's automatic prefix caching does,
except that the match is not cut to whole pages. Its outputs are those of a run without the cache.

Exact prompts of compressing requests (`exact_prompts`, on in the embedded engine): a compressing request
keeps its prompt's exact cache too, just before its policy compresses (`store_prompt`; the compaction then
copies the shared pages it writes into), and a later compressing request reads an exact entry's tokens up
to the first position its policy needs its own prefill to compute (`KVPolicy.reusable_prefix`: the start
of its observation window; none for a policy whose statistics span every prompt token), then prefills
the rest and compresses as without the entry (`find_exact`). A shared system prompt is so prefilled once.
Its outputs are those of a run without the cache whose prefill is cut into chunks at the same token.

Automatic matching (`matching="auto"`, opt-in because it changes what a compressing policy sees):

- Entries are also indexed by chained page hashes of their tokens (page i's hash covers the
  namespace, i.e. model and policy repr, and every token of pages 0..i, as vLLM's block hashes do).
  A request attaches to the stored entry that gives the longest usable prefix of its prompt; the
  hashes only narrow the candidates, the tokens themselves are compared, so a collision cannot
  attach wrong tokens. At least one whole page must match, and at least one prompt token must be left
  to run (a prompt equal to a stored context does not attach; a session entry, below, is cut short).
- When a request finishes normally, its row stays as a *session* entry: the compressed context plus
  every token written after it (question, answer), with its compression boundary b. A later request
  (the next turn) attaches to the longest part of it that is a token prefix of its prompt, at m
  tokens with b <= m <= the entry's length; the entries at positions >= m are cut from its fork
  (`PagedKVCache.truncate_request`). A policy that evicts during decode (H2O, ...) changes its
  entries and state at every token, so its session entries attach only whole (m = their length).
- The attached request then behaves exactly as if it had named b as its context (`compress_after` =
  b): tokens m.. of its prompt run from the cache (one prefill chunk where the policy allows,
  `ModelRunner.runs_tail_as_chunk`, else decode steps). A request that names its context
  only attaches to entries compressed at that same boundary; one whose boundary is a fallback
  (`context_is_fallback`: chat's "every message but the last") takes any match first.

Memory stays the scheduler's: entries are dropped least recently used first (their references
released) before any running request is preempted and before a waiting prefill is refused; an
entry that a running request attached to is never dropped. Not cached: requests whose policy gates
writes during prefill (WG-KV: its ring and admission flags are sized per request), and attaching
is skipped for requests that ask for prompt log-probabilities (those come from the prefill).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.api import PREFIX_MATCHING_MODES
from vllm_kvpress_ext.cache import InvalidPlanError, PagedKVCache, RequestCapacityError
from vllm_kvpress_ext.cache.pool import PoolExhaustedError
from vllm_kvpress_ext.engine.request import KVStats, Request
from vllm_kvpress_ext.engine.stats import PrefixStoreStats


@dataclass
class CachedPrefix:
    key: str
    row_id: str  # the store's own row in the cache
    length: int  # tokens whose K/V went into the row: positions 0 .. length - 1
    policy_state: Any
    kv: KVStats
    users: int = 0  # live leases on it (`PrefixStore.lease`, `PrefixLease.release`): it is not evicted while > 0
    tokens: tuple[int, ...] = ()  # the token ids of positions 0 .. length - 1
    namespace: str = ""  # model and policy repr (`prefix_namespace`)
    boundary: int = 0  # tokens prefilled before the policy compressed; the rest was written after it
    truncatable: bool = False  # whether a request may attach to a part of it (m in [boundary, length])
    page_hashes: tuple[bytes, ...] = ()  # its whole pages' chained hashes, under which the index lists it


@dataclass
class StoreView:
    """The store as a scheduler that mirrors it sees it (`PrefixStore.view`): every key, the entries it did not
    know yet (their tokens and boundaries; no row, policy state or figures), the pages dropping every unused
    entry would free, and the store's figures."""

    model_dir: str
    matching: str
    keys: list[str]
    added: list[CachedPrefix]
    evictable_pages: int
    stats: PrefixStoreStats


@dataclass(eq=False)
class PrefixLease:
    """A hold on a stored entry, for a request about to attach to it or attached to it: while any lease on an
    entry is live the entry is not evicted. Only `PrefixStore.lease` makes one and `release` ends it, once (a
    second call does nothing), so no path counts an entry's users by hand."""

    entry: CachedPrefix
    live: bool = True

    @property
    def key(self) -> str:
        return self.entry.key

    def release(self) -> None:
        if self.live:
            self.live = False
            self.entry.users -= 1


@dataclass
class Attachment:
    """A stored prefix a request starts from (`PrefixStore.attach_at`): its row, forked from the entry's and cut to
    `length` tokens, and the lease that keeps the entry while the row reads it. The runner seats the request on it.

    `entry` is the entry whose boundary, policy state and figures the request takes: it runs on from there as if
    it had compressed that prefix itself. It is None for a compressing request that read an uncompressed entry's
    tokens: that request prefills on from `length` and compresses when its prefill completes, as without the entry.
    """

    row: int
    lease: PrefixLease
    length: int
    entry: CachedPrefix | None


def prefix_namespace(model_dir: str | Path, policy: Any) -> str:
    """What two entries must share to be interchangeable: the model and the policy with all its parameters."""
    return f"{model_dir}\0{policy!r}"


def prefix_key(model_dir: str | Path, policy: Any, token_ids: list[int]) -> str:
    """Content key of a compressed prefix: the model, the policy with all its parameters, the tokens."""
    digest = hashlib.sha256()
    digest.update(str(model_dir).encode())
    digest.update(b"\0" + repr(policy).encode() + b"\0")
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.hexdigest()


def page_hashes(namespace: str, token_ids: list[int] | tuple[int, ...], page_size: int) -> list[bytes]:
    """Chained hash of every whole page: page i's covers the namespace and the tokens of pages 0..i."""
    hashes: list[bytes] = []
    previous = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = ",".join(map(str, token_ids[start : start + page_size])).encode()
        previous = hashlib.blake2b(previous + page, digest_size=16).digest()
        hashes.append(previous)
    return hashes


def common_prefix_length(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def session_entry(
    model_dir: str | Path, page_size: int, policy: Any, tokens: list[int], boundary: int
) -> CachedPrefix | None:
    """What a finished request's row is stored as (without its row, state and figures), or None when it
    is not kept (no whole page, so no hash could ever find it). The vLLM plugin's scheduler predicts its
    mirror's entries with it, so its keys are the store's."""
    length = len(tokens)
    if length < max(boundary, page_size):
        return None
    key = prefix_key(model_dir, policy, tokens)
    if boundary != length:
        key += f"@{boundary}"
    namespace = prefix_namespace(model_dir, policy)
    # A policy that evicts during decode moves its entries and state at every token: attach whole only.
    evicts = policy is not None and policy.wants_decode_steps
    return CachedPrefix(
        key,
        "",
        length,
        None,
        KVStats(),
        tokens=tuple(tokens),
        namespace=namespace,
        boundary=boundary,
        truncatable=not evicts,
        page_hashes=tuple(page_hashes(namespace, tokens, page_size)),
    )


class PrefixIndex:
    """What matching needs of the stored prefixes (tokens, boundaries, page hashes), without cache rows.

    `PrefixStore` is one with the rows; the vLLM plugin's scheduler keeps another as a mirror of its
    worker's store, so that it can tell vLLM how many prompt tokens a request will find computed.
    """

    def __init__(self, model_dir: str | Path, page_size: int, matching: str = "named") -> None:
        if matching not in PREFIX_MATCHING_MODES:
            raise ValueError(f"prefix matching must be one of {', '.join(PREFIX_MATCHING_MODES)}, got {matching!r}")
        self.model_dir = str(model_dir)
        self.page_size = page_size
        self.matching = matching
        self.entries: OrderedDict[str, CachedPrefix] = OrderedDict()
        self.index: dict[bytes, set[str]] = {}  # page hash -> keys of the entries holding that page (auto)

    @property
    def auto(self) -> bool:
        return self.matching == "auto"

    def register(self, entry: CachedPrefix) -> None:
        self.entries[entry.key] = entry
        for page_hash in entry.page_hashes:
            self.index.setdefault(page_hash, set()).add(entry.key)

    def unregister(self, key: str) -> CachedPrefix:
        entry = self.entries.pop(key)
        for page_hash in entry.page_hashes:
            holders = self.index[page_hash]
            holders.discard(key)
            if not holders:
                del self.index[page_hash]
        return entry

    def find(self, prompt: list[int], policy: Any, named: int | None) -> tuple[CachedPrefix, int] | None:
        """The entry and token count a prompt can start from, longest first; None if there is none.

        `named`: the context boundary the request names (it then attaches only to entries compressed
        there); None when it names none or its boundary is only a fallback.
        """
        best: tuple[CachedPrefix, int] | None = None
        if named is not None and named < len(prompt):
            entry = self.entries.get(prefix_key(self.model_dir, policy, prompt[:named]))
            if entry is not None:
                best = (entry, entry.length)
        if not self.auto and policy is not None:  # uncompressed entries are exact: matched in every mode
            return best
        namespace = prefix_namespace(self.model_dir, policy)
        for entry in self._candidates(namespace, prompt):
            usable = self.usable_length(entry, namespace, prompt, named)
            if usable and (best is None or usable > best[1]):
                best = (entry, usable)
        return best

    def find_exact(self, prompt: list[int], limit: int) -> tuple[CachedPrefix, int] | None:
        """The uncompressed entry giving the most of `prompt`'s first `limit` tokens (at least a page), and how
        many: where a compressing request may start its own prefill (`KVPolicy.reusable_prefix` gives `limit`)."""
        if limit < self.page_size:
            return None
        best: tuple[CachedPrefix, int] | None = None
        namespace = prefix_namespace(self.model_dir, None)
        for entry in self._candidates(namespace, prompt[:limit]):
            usable = min(limit, self.usable_length(entry, namespace, prompt, None))
            if usable >= self.page_size and (best is None or usable > best[1]):
                best = (entry, usable)
        return best

    def _candidates(self, namespace: str, prompt: list[int]) -> list[CachedPrefix]:
        """The entries of `namespace` listed under the prompt's leading page hashes, deepest shared page first."""
        hashes = page_hashes(namespace, prompt, self.page_size)
        depth = 0
        while depth < len(hashes) and hashes[depth] in self.index:
            depth += 1
        found: list[CachedPrefix] = []
        seen: set[str] = set()
        for level in range(depth - 1, -1, -1):
            for key in self.index[hashes[level]] - seen:
                seen.add(key)
                found.append(self.entries[key])
        return found

    def usable_length(self, entry: CachedPrefix, namespace: str, prompt: list[int], named: int | None) -> int:
        """Tokens of `entry` a request with `prompt` can start from (0: none), compared token by token."""
        if entry.namespace != namespace or (named is not None and entry.boundary != named):
            return 0
        common = common_prefix_length(entry.tokens, prompt)
        if common < self.page_size:  # diverges inside the first page (or a hash collision)
            return 0
        usable = min(common, len(prompt) - 1)  # at least one prompt token must be left to run
        if usable < entry.boundary:  # the compressed context is used whole or not at all
            return 0
        if not entry.truncatable and usable != entry.length:
            return 0
        return usable


class PrefixStore(PrefixIndex):
    """Up to `capacity` compressed prefixes, each held by a cache row of its own, in LRU order."""

    def __init__(
        self,
        cache: PagedKVCache,
        model_dir: str | Path,
        capacity: int,
        matching: str = "named",
        exact_prompts: bool = False,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"the prefix store needs a capacity >= 1, got {capacity}")
        super().__init__(model_dir, cache.page_size, matching)
        self.cache = cache
        self.capacity = capacity
        # Whether compressing requests keep their prompt's exact cache (`store_prompt`) and start their prefill
        # from an exact entry's tokens (`find_exact`), as requests without a policy always do.
        self.exact_prompts = exact_prompts
        self.hits = 0
        self.tokens_reused = 0
        self.stored = 0
        self.evicted = 0

    def cacheable(self, request: Request) -> bool:
        """Whether the request's cache may be stored or attached to at all: any request but one whose policy
        gates writes (a write gate's ring is per request). An uncompressed request's cache is exact, so it is
        stored and reused in every matching mode; a compressed one by name, or in `auto` by its tokens."""
        return request.seat.admission is None

    @staticmethod
    def boundary(request: Request) -> int | None:
        """The prefix length a request could share, or None when it has no cacheable boundary."""
        c = request.compress_after
        if request.policy is None or request.seat.admission is not None or c is None:
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
        if key is None or key in self.entries or request.seat.num_processed != request.compress_after:
            return
        tokens = tuple(request.prompt_token_ids[: request.seat.num_processed])
        namespace = prefix_namespace(self.model_dir, request.policy)
        hashes = tuple(page_hashes(namespace, tokens, self.page_size)) if self.auto else ()
        context = CachedPrefix(
            key,
            "",
            len(tokens),
            None,
            KVStats(),
            tokens=tokens,
            namespace=namespace,
            boundary=len(tokens),
            page_hashes=hashes,
        )  # a named context is used whole (truncatable False)
        self._add_entry(request, context)

    def store_prompt(self, request: Request) -> None:
        """Keep the exact cache of a compressing request's prefill, just before its policy compresses it: an
        uncompressed entry (boundary 0, as a request without a policy leaves) that later prompts sharing its
        tokens read instead of recomputing them. Its pages stay shared until the compaction copies the pages it
        writes into (copy-on-write), so keeping it costs the kept entries' pages, and those only until it is
        evicted, least recently used first, like any entry."""
        if not self.exact_prompts or request.seat.row is None or not self.cacheable(request):
            return
        tokens = request.all_token_ids[: request.seat.num_processed]
        entry = session_entry(self.model_dir, self.page_size, None, tokens, 0)
        if entry is None:
            return
        if entry.key in self.entries:
            self.entries.move_to_end(entry.key)
            return
        self._add_entry(request, entry)

    def session_boundary(self, request: Request) -> int | None:
        """Where the session entry `store_session` keeps of `request` starts being usable, or None when it keeps
        nothing (no completed prefill; a compressed cache outside `auto` matching). A compressed context is
        used whole, so its entry's boundary is where the policy compressed; nothing was compressed in an
        uncompressed one, so any prefix of it is exact: boundary 0."""
        if request.seat.compressed_at is None or not self.cacheable(request):
            return None
        if request.policy is None:
            return 0
        return request.seat.compressed_at if self.auto else None

    def store_session(self, request: Request) -> None:
        """Keep what a finished request left: its compressed context plus every token written after it, for a
        later turn to attach to (auto matching), or, uncompressed, for any later prompt that shares a page or
        more of its tokens (every mode)."""
        boundary = self.session_boundary(request)
        if boundary is None or request.seat.row is None:
            return
        tokens = request.all_token_ids[: request.seat.num_processed]
        entry = session_entry(self.model_dir, self.page_size, request.policy, tokens, boundary)
        if entry is None or entry.key in self.entries:
            return
        self._add_entry(request, entry)

    def _add_entry(self, request: Request, entry: CachedPrefix) -> None:
        """Store `entry` (everything but its row, policy state and figures) with a fork of the request's row."""
        kv = copy.deepcopy(dataclasses.replace(request.seat.kv, kept=None))
        self.keep_row(request.request_id, entry, copy.deepcopy(request.seat.policy_state), kv)

    def keep_row(self, source_id: Hashable, entry: CachedPrefix, policy_state: Any, kv: KVStats) -> bool:
        """Store `entry` with a fork of cache row `source_id` (pages shared), the policy state and the figures it
        continues from; False when it cannot be (every entry in use, no row or no pages for the fork)."""
        if len(self.entries) >= self.capacity and self.evict_one() is None:
            return False
        row_id = f"prefix:{entry.key}"
        try:
            self.cache.fork_request(source_id, row_id)
        except (RequestCapacityError, PoolExhaustedError):
            return False
        self.register(dataclasses.replace(entry, row_id=row_id, policy_state=policy_state, kv=kv))
        self.stored += 1
        return True

    def fork_entry(self, lease: PrefixLease, child_id: Hashable, hit: bool = True) -> int:
        """A cache row for `child_id` reading the leased entry whole (pages shared, copy-on-write), counted as a
        hit unless `hit` is False (a request that waited for the entry to be built); the child holds the lease
        until it frees the row. Raises what `fork_request` raises."""
        entry = lease.entry
        row = self.cache.fork_request(entry.row_id, child_id)
        self.entries.move_to_end(entry.key)
        if hit:
            self.hits += 1
            self.tokens_reused += entry.length
        return row

    def match(self, request: Request) -> tuple[CachedPrefix, int] | None:
        """The entry and token count a request can attach to, longest first; None if there is none."""
        if request.params.prompt_logprobs is not None or not self.cacheable(request):
            return None
        # A preempted request recomputes. Attached again, it would pin the entry it was preempted beside,
        # and a request that alone outgrows the pool beside that entry would be preempted and re-attached
        # forever; recomputing, it reserves its pages, the entry is evictable, and it either fits or ends
        # with "length" (`LLMEngine._stop_if_pool_too_small`).
        if request.num_preemptions:
            return None
        # A boundary only names a context for a compressing policy (without one the whole prompt is prefilled).
        named = None if request.context_is_fallback or request.policy is None else request.compress_after
        found = None
        if named is None or self.boundary(request) is not None:  # a context that is the whole prompt shares nothing
            found = self.find(request.prompt_token_ids, request.policy, named)
        if found is None and self.exact_prompts and request.policy is not None:
            reusable = request.policy.reusable_prefix(request.prefill_target)
            found = self.find_exact(request.prompt_token_ids, reusable)
        return found

    def attach(self, request: Request) -> Attachment | None:
        """A stored prefix for `request` to start from, if there is one (`attach_at` on the longest match)."""
        found = self.match(request)
        if found is None:
            return None
        entry, length = found
        return self.attach_at(request, self._lease(entry), length)

    def lease(self, key: str) -> PrefixLease | None:
        """A hold on entry `key` for a request about to attach to it, so that nothing evicts it first; None when
        the store no longer has it."""
        entry = self.entries.get(key)
        return None if entry is None else self._lease(entry)

    @staticmethod
    def _lease(entry: CachedPrefix) -> PrefixLease:
        entry.users += 1
        return PrefixLease(entry)

    def attach_at(self, request: Request, lease: PrefixLease, length: int) -> Attachment | None:
        """A row for `request` holding the first `length` tokens of the leased entry, the lease handed on with it
        (the request holds it until it gives its row back). The request itself is not changed: its runner seats it.

        None (the lease released, nothing changed) when the entry is gone, no row is free, or the entry cannot give
        those tokens: the request then computes them itself.
        """
        entry = lease.entry
        if not lease.live or self.entries.get(entry.key) is not entry:
            lease.release()
            return None
        tokens = request.all_token_ids
        # A compressing request reading an uncompressed entry goes on with its own prefill from `length`.
        prefilling = request.policy is not None and entry.namespace == prefix_namespace(self.model_dir, None)
        valid = entry.boundary <= length <= entry.length and length < len(tokens)
        if prefilling:
            assert request.policy is not None
            valid = valid and self.exact_prompts and length <= request.policy.reusable_prefix(request.prefill_target)
        if (
            not valid
            or (length != entry.length and not entry.truncatable)
            or entry.tokens[:length] != tuple(tokens[:length])
        ):
            lease.release()
            return None
        try:
            row = self.cache.fork_request(entry.row_id, request.request_id)
        except RequestCapacityError:
            lease.release()
            return None
        if length < entry.length:
            try:
                self.cache.truncate_request(request.request_id, length)
            except InvalidPlanError:  # a sliding-window ring moved past `length`: it cannot be cut back
                self.cache.free_request(request.request_id)
                lease.release()
                return None
        self.entries.move_to_end(entry.key)
        self.hits += 1
        self.tokens_reused += length
        return Attachment(row, lease, length, None if prefilling else entry)

    def unattach(self, request: Request) -> None:
        """Take back the figures of an attach the request gives up before running (its row goes back, and its lease
        ends, with its runner's `release`)."""
        self.hits -= 1
        self.tokens_reused -= request.seat.cached_tokens

    def evict_one(self) -> int | None:
        """Drop the least recently used entry no running request is attached to.

        Returns the pages that went back to the free list (0 when all its pages are still referenced
        elsewhere), or None when every entry is in use (or there is none).
        """
        for key, entry in self.entries.items():
            if entry.users == 0:
                before = self.cache.pool.num_free
                self.cache.free_request(entry.row_id)
                self.unregister(key)
                self.evicted += 1
                return self.cache.pool.num_free - before
        return None

    def evict_until(self, free_pages: int) -> None:
        """Drop unused entries, least recently used first, until the pool has `free_pages` free (or none is left)."""
        while self.cache.pool.num_free < free_pages and self.evict_one() is not None:
            pass

    def evictable_pages(self) -> int:
        """Pages that would go back to the free list if every entry no running request uses were dropped."""
        rows = [self.cache.row_of(e.row_id) for e in self.entries.values() if e.users == 0]
        if not rows:
            return 0
        tables = self.cache.block_tables[:, rows]
        pages = tables[tables >= 0].to(torch.int64)
        held = torch.bincount(pages, minlength=self.cache.pool.num_pages)
        used = held.nonzero().view(-1)
        return int((self.cache.pool.refcounts(used) == held[used].to(torch.int32)).sum())

    def clear(self) -> None:
        while self.entries and self.evict_one() is not None:
            pass

    def pages_held(self) -> int:
        """Pages the stored prefixes reference (a page shared with a running request counts too)."""
        return sum(self.cache.usage(entry.row_id).pages for entry in self.entries.values())

    def stats(self) -> PrefixStoreStats:
        """Cumulative hits and reused tokens, and what the store holds now."""
        return PrefixStoreStats(self.hits, self.tokens_reused, self.pages_held(), len(self.entries))

    def view(self, known: set[str]) -> StoreView:
        """What a scheduler that mirrors this store needs, given the keys it already knows."""
        current = set(self.entries)
        added = [
            dataclasses.replace(self.entries[key], row_id="", policy_state=None, kv=KVStats())  # its tokens only
            for key in current - known
        ]
        return StoreView(self.model_dir, self.matching, sorted(current), added, self.evictable_pages(), self.stats())
