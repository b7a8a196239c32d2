"""`ModelRunner`: the forward pass, the per-(layer, KV head) page pool and the policy hooks, given a schedule.

Two schedulers drive it: the embedded engine's (`LLMEngine.step`) and vLLM's (the plugin's worker,
`vllm_kvpress_ext.vllm_plugin.worker`). A driver owns starting, preempting, sampling and stopping;
it hands the runner a `Schedule` (which requests prefill which token chunks, which decode one
token) of requests that already hold a cache row, and gets back the logits of every request whose
step produced a next token. The runner runs the prefill chunks as one forward pass and the decodes
as another, and calls each request's policy exactly where the embedded engine always has: after
each layer of a layer-wise prefill, at prefill completion, and after every decode step.

Failures are confined to the request that caused them wherever the batch allows: a policy hook
that raises, a capture that cannot be built, or a request whose pages do not fit is reported in
`RunnerOutput.failed` and left out of the rest of the step; the other requests' outputs are
unchanged. Only an error in the shared forward pass itself propagates (then the whole batch's cache
state is undefined, and the driver must fail the batch).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.cache import PagedKVCache, PagePool, RequestCapacityError
from vllm_kvpress_ext.cache.pool import DEFAULT_KV_MEMORY, PoolExhaustedError
from vllm_kvpress_ext.engine.admission import PromptAdmission, bind_admission
from vllm_kvpress_ext.engine.attention_context import DecodeContext, PrefillContext, PrefillSegment
from vllm_kvpress_ext.engine.compression import compress_prefill, evict_after_decode, layer_prefill
from vllm_kvpress_ext.engine.environment import cpu_paths_summary
from vllm_kvpress_ext.engine.host_allocator import tune_host_allocator
from vllm_kvpress_ext.engine.kept import kept_entries
from vllm_kvpress_ext.engine.layerwise import LayerwiseCompression, prefill_reservation
from vllm_kvpress_ext.engine.origins import (
    PREFILL,
    ForkOf,
    LeasedPrefix,
    LoadedEntries,
    MatchedPrefix,
    Origin,
    Prefill,
)
from vllm_kvpress_ext.engine.prefix_store import Attachment, PrefixLease, PrefixStore, StoreView
from vllm_kvpress_ext.engine.reconstruction import score_by_reconstruction
from vllm_kvpress_ext.engine.request import Request, RequestRejectedError, RequestStatus
from vllm_kvpress_ext.engine.sampler import token_logprobs
from vllm_kvpress_ext.engine.sampling_params import SamplingParams
from vllm_kvpress_ext.engine.stats import PrefixStoreStats
from vllm_kvpress_ext.hub.pull import resolve_model
from vllm_kvpress_ext.models import load_model
from vllm_kvpress_ext.models.loader import resolve_dtype
from vllm_kvpress_ext.models.write_gate import GateStore
from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.policies.base import Admission, AdmissionPolicy, LayerPrefill
from vllm_kvpress_ext.policies.capture import PrefillCapture
from vllm_kvpress_ext.utils.huge_pages import move_to_huge_pages

logger = logging.getLogger(__name__)


@dataclass
class ScheduledChunk:
    """Prompt (or recomputed) tokens [start, end) of `request` to prefill in this step."""

    request: Request
    start: int
    end: int


@dataclass
class Schedule:
    """One step's work: prefill chunks and decoding requests (disjoint), all holding a cache row."""

    prefill: list[ScheduledChunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclass
class RequestFailure:
    request: Request
    error: Exception

    @property
    def message(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"


@dataclass
class RunnerOutput:
    """`logits[i]` is the next-token distribution of `sample[i]`; `failed` requests did not complete the step."""

    sample: list[Request] = field(default_factory=list)
    logits: torch.Tensor | None = None
    failed: list[RequestFailure] = field(default_factory=list)


class ModelRunner:
    """The model and its paged KV cache; `execute(schedule)` runs one step."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: torch.dtype | str = "auto",
        device: str | torch.device = "cpu",
        num_pages: int | None = None,
        kv_memory: int | None = None,
        page_size: int = 16,
        max_num_seqs: int = 64,
        kv_dtype: torch.dtype | str | None = None,
        max_cached_prefixes: int = 0,
        prefix_matching: str = "named",
        exact_prompt_reuse: bool = False,
    ) -> None:
        # A catalog name ("smollm2-135m") works wherever a model path does: its cached GGUF file, pulled
        # first if needed. An existing path always wins over a catalog name.
        self.model_dir = resolve_model(model_dir)
        self.device = torch.device(device)
        if self.device.type == "cpu":
            tune_host_allocator()  # activations reuse freed blocks instead of faulting in fresh pages
        self.model = load_model(self.model_dir, dtype=dtype, device=self.device)
        weights_arena = move_to_huge_pages(self.model) if self.device.type == "cpu" else None  # read every step
        self.config = self.model.config
        self.dtype = next(self.model.parameters()).dtype
        cache_dtype = self.dtype if kv_dtype is None else resolve_dtype(kv_dtype)
        if num_pages is not None and kv_memory is not None:
            raise ValueError("give num_pages or kv_memory, not both")
        if num_pages is None:
            budget = DEFAULT_KV_MEMORY if kv_memory is None else kv_memory
            num_pages = PagePool.pages_for_memory(budget, page_size, self.config.head_dim, cache_dtype)
        self.cache = PagedKVCache(
            self.config.num_hidden_layers,
            self.config.num_key_value_heads,
            self.config.head_dim,
            num_pages=num_pages,
            page_size=page_size,
            # Cached compressed prefixes (`max_cached_prefixes`, 0 = off) hold rows of their own.
            max_requests=max_num_seqs + max_cached_prefixes,
            dtype=cache_dtype,
            device=self.device,
            layer_windows=self.config.layer_windows,
        )
        # With `exact_prompt_reuse` (the embedded engine), compressing requests also keep their exact prompts and
        # start their prefill after an exact entry's tokens; the plugin's own runner, whose scheduler mirrors the
        # store's entries to tell vLLM what is computed, keeps to compressed contexts and uncompressed requests.
        self.prefix_store = (
            PrefixStore(self.cache, self.model_dir, max_cached_prefixes, prefix_matching, exact_prompt_reuse)
            if max_cached_prefixes > 0
            else None
        )
        self.scale = self.config.attention_scale
        # The write gates this runner's requests use (WG-KV): loaded once per file, never shared with another runner.
        self.gate_store = GateStore()
        self._weights_arena = weights_arena
        if self.device.type == "cpu" and logger.isEnabledFor(logging.INFO):  # reading smaps costs a few ms
            logger.info("CPU paths: %s", self.cpu_paths())

    def cpu_paths(self) -> str:
        """The CPU paths this runner's model runs on (`engine/environment.py`): for the startup log."""
        return cpu_paths_summary(self.dtype, self.cache.pool.kv, self._weights_arena)

    # ------------------------------------------------------------------ requests

    def clock(self) -> float:
        """Seconds for timing compression: on a GPU, after the queued work is done, so the time is its own."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def new_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        policy: KVPolicy | None,
        *,
        max_model_len: int,
        max_new_tokens: int | None = None,
        compress_after: int | None = None,
    ) -> Request:
        """A request that can run on this runner, or `RequestRejectedError` saying why it never can.

        The one way in for the embedded engine and the vLLM worker alike, so both hold every request to
        the same checks: token ids in the vocabulary, the model's length, `compress_after` in the prompt,
        a write gate that fits the model and a ring that fits the pool, and a prefill peak that fits the
        whole pool. `max_new_tokens` (default: `params.max_tokens`) bounds what the request can write.
        """
        if not token_ids:
            raise RequestRejectedError("the prompt is empty")
        vocab = self.config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise RequestRejectedError(f"prompt token ids must lie in [0, {vocab})")
        if len(token_ids) >= max_model_len:
            raise RequestRejectedError(
                f"prompt has {len(token_ids)} tokens; the model's limit is {max_model_len} (prompt + output)"
            )
        if compress_after is not None and (not isinstance(compress_after, int) or isinstance(compress_after, bool)):
            raise TypeError(f"compress_after must be an integer or None, got {compress_after!r}")
        if compress_after is not None and not 0 < compress_after <= len(token_ids):
            raise RequestRejectedError(f"compress_after must lie in [1, {len(token_ids)}], got {compress_after}")
        request = Request(request_id, token_ids, params, compress_after=compress_after, policy=policy)
        # The last sampled token is never written to the cache: prompt + new tokens - 1 entries at most.
        new_tokens = params.max_tokens if max_new_tokens is None else max_new_tokens
        request.seat.admission = self.admission_for(policy, min(len(token_ids) + new_tokens - 1, max_model_len))
        pool_pages = self.cache.pool.num_pages
        peak = self.cache.pages_for_prompt(request.prefill_target)
        if peak > pool_pages:
            raise RequestRejectedError(
                f"prompt needs {peak} KV pages before compression but the whole pool has {pool_pages}"
            )
        return request

    def admission_for(self, policy: KVPolicy | None, max_entries: int | None = None) -> Admission | None:
        """The policy's write gate bound to this model and pool (`engine/admission.py`), or None."""
        return bind_admission(policy, self.cache, self.model_dir, self.device, self.gate_store, max_entries)

    def start(self, request: Request, origin: Origin = PREFILL) -> bool:
        """Seat the request on a row from `origin` (`engine/origins.py`): True once it holds one.

        False, with nothing changed, where the origin cannot be used: no row or page for a fork, no stored
        prefix that matches, or one that can no longer be attached (its lease is then released).
        """
        match origin:
            case Prefill():
                self._seat_fresh(request)
            case ForkOf(parent):
                return self._seat_fork(parent, request)
            case MatchedPrefix():
                store = self.prefix_store
                return self._seat_on_prefix(request, None if store is None else store.attach(request))
            case LeasedPrefix(lease, length):
                if self.prefix_store is None:
                    lease.release()
                    return False
                return self._seat_on_prefix(request, self.prefix_store.attach_at(request, lease, length))
            case LoadedEntries(keys, values, capture):
                self._seat_fresh(request)
                assert request.seat.row is not None
                n = keys.shape[2]
                slots = self.cache.append_slots([request.seat.row], torch.arange(n).view(1, -1))  # [L, 1, H, n]
                self.cache.write(slots[:, 0], keys, values)
                request.seat.num_processed = n
                request.seat.capture = capture
        return True

    def _seat_fresh(self, request: Request) -> None:
        """A row of its own: the prefill starts (or, after a preemption, restarts) from token 0."""
        request.seat.row = self.cache.add_request(request.request_id)
        request.status = RequestStatus.PREFILLING
        request.seat.num_processed = 0
        request.seat.cached_tokens = 0
        request.seat.compressed_at = None

    def _seat_fork(self, parent: Request, child: Request) -> bool:
        """Another sample of `parent`'s prompt on a fork of its row, with its state after the prompt
        (`engine/samples.py`); False, with nothing changed, when no row or page is free."""
        try:
            child.seat.row = self.cache.fork_request(parent.request_id, child.request_id)
        except (RequestCapacityError, PoolExhaustedError):
            return False
        child.status = RequestStatus.RUNNING
        child.seat.num_processed = parent.seat.num_processed
        child.seat.compressed_at = parent.seat.compressed_at
        child.seat.policy_state = copy.deepcopy(parent.seat.policy_state)
        child.seat.admission = parent.seat.admission
        child.seat.prompt_admission = parent.seat.prompt_admission
        child.prompt_logprobs = list(parent.prompt_logprobs)
        # The prompt's figures are the parent's; the compression work was the parent's alone.
        child.seat.kv = dataclasses.replace(
            parent.seat.kv,
            compression_seconds=0.0,
            mean_kept_per_layer=list(parent.seat.kv.mean_kept_per_layer),
            counters=dict(parent.seat.kv.counters),
        )
        return True

    def release(self, request: Request) -> None:
        """Return the request's pages and row (its policy state stays readable, e.g. after it finished)."""
        if request.seat.row is not None:
            self.cache.free_request(request.request_id)
            request.seat.row = None
        if request.seat.prefix_lease is not None:  # the stored prefix its row was forked from may go now
            request.seat.prefix_lease.release()
            request.seat.prefix_lease = None

    def _seat_on_prefix(self, request: Request, attachment: Attachment | None) -> bool:
        """Seat a request on a stored prefix's row: decoding (or running its prompt's tail) after an entry it takes
        whole, compressed or not; prefilling on, for a compressing request that read an entry's exact tokens.
        False without an attachment."""
        if attachment is None:
            return False
        request.seat.row = attachment.row
        request.seat.prefix_lease = attachment.lease
        request.seat.num_processed = request.seat.cached_tokens = attachment.length
        entry = attachment.entry
        if entry is None:
            request.status = RequestStatus.PREFILLING
            return True
        request.compress_after = request.seat.compressed_at = entry.boundary
        request.context_is_fallback = False
        request.seat.policy_state = copy.deepcopy(entry.policy_state)
        request.seat.kv = copy.deepcopy(entry.kv)
        request.seat.kv.prompt_tokens = len(request.prompt_token_ids)
        request.status = RequestStatus.RUNNING
        self.update_kv_stats(request)
        return True

    def detach_prefix(self, request: Request) -> None:
        """Undo an attach that left the request prefilling (no room for the rest of its prefill): it waits again
        and starts from token 0, or from an entry, when it next fits."""
        assert self.prefix_store is not None and request.status is RequestStatus.PREFILLING
        self.prefix_store.unattach(request)
        self.release(request)
        request.status = RequestStatus.WAITING
        request.seat.num_processed = 0
        request.seat.cached_tokens = 0

    def attached_prefill_reservation(self, request: Request) -> int:
        """Pages to reserve for the prefill of a request that read its first `num_processed` tokens from an
        exact entry: the whole prompt, as for any prefill (the pages it reads count among those it holds), plus
        a copy of the pages it reads, which the compaction copies where it moves kept entries into them."""
        return self.cache.pages_for_prompt(request.prefill_target) + self.cache.pages_for_prompt(
            request.seat.num_processed
        )

    def keep_session(self, request: Request) -> None:
        """A request finished normally: its cache stays for later prompts that share its tokens (uncompressed,
        in every matching mode) or for a later turn (compressed, with automatic matching)."""
        if self.prefix_store is not None and request.seat.row is not None:
            self.prefix_store.store_session(request)

    def prefix_store_stats(self) -> PrefixStoreStats | None:
        """The compressed prefix store's cumulative hits and reused tokens and what it holds now (None: off)."""
        return None if self.prefix_store is None else self.prefix_store.stats()

    def prefix_store_view(self, known: set[str]) -> StoreView | None:
        """The prefix store as a driver that mirrors it sees it, given the keys it knows (None: the store is off)."""
        return None if self.prefix_store is None else self.prefix_store.view(known)

    def lease_prefix(self, key: str) -> PrefixLease | None:
        """A hold on the stored prefix `key`, which keeps it from being dropped until released (None: not there)."""
        return None if self.prefix_store is None else self.prefix_store.lease(key)

    def session_boundary(self, request: Request) -> int | None:
        """Where a stored session of the request would start its compressed context (None: it would store none)."""
        return None if self.prefix_store is None else self.prefix_store.session_boundary(request)

    def free_pages_for(self, pages: int) -> None:
        """Drop unused stored prefixes, least recently used first, until `pages` are free or none is left."""
        if self.prefix_store is not None:
            self.prefix_store.evict_until(pages)

    def evict_cached_prefix(self) -> int | None:
        """Drop the least recently used unused cached prefix: pages freed, or None if none can go."""
        return None if self.prefix_store is None else self.prefix_store.evict_one()

    def _evicted_a_cached_prefix(self) -> bool:
        """For a compaction that must copy pages a cached entry shares and finds the pool full."""
        return self.evict_cached_prefix() is not None

    def reset(self, request: Request) -> None:
        """Release the request and forget its policy state: it will be recomputed from token 0."""
        self.release(request)
        request.seat.policy_state = None
        request.seat.capture = None
        request.seat.prompt_admission = None

    def preempt(self, request: Request) -> None:
        """Free the request's pages and mark it waiting to be recomputed (its output tokens stay)."""
        self.reset(request)
        request.status = RequestStatus.WAITING
        request.seat.num_processed = 0
        request.num_preemptions += 1

    # ------------------------------------------------------------------ pool figures for the drivers

    @property
    def total_pages(self) -> int:
        return self.cache.pool.num_pages

    @property
    def free_pages(self) -> int:
        return self.cache.pool.num_free

    @property
    def page_size(self) -> int:
        """Tokens per page (of one layer and KV head)."""
        return self.cache.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: K and V of `page_size` tokens of one (layer, KV head)."""
        return self.cache.pool.bytes_per_page

    def pages_held(self, request: Request) -> int:
        """Pages the request's row references, over every (layer, KV head), ring included (0 without a row)."""
        if request.seat.row is None:
            return 0
        return int(self.cache.pages_per_head(request.request_id).sum())

    def runs_tail_as_chunk(self, request: Request) -> bool:
        """Whether the prompt tokens a request still owes after its policy compressed (the question after its
        context, the rest of a prompt after an attached prefix) run as prefill chunks over the compressed
        cache rather than one decode step each.

        The attention is the same either way: each token sees the compressed entries and the tokens before
        it (the chunk's paged prefill masks by position). A chunk does it in one pass. Policies that act at
        every decode step keep the steps, since their per-token hooks are part of what they compute: H2O's
        accumulated scores, decode-time attention, and WG-KV's gated ring.
        """
        policy = request.policy
        return (
            request.status is RequestStatus.RUNNING
            and request.num_tokens - request.seat.num_processed > 1
            and request.seat.admission is None
            and (policy is None or not (policy.wants_decode_steps or policy.wants_decode_attention))
        )

    def pages_to_decode(self, requests: list[Request], tokens: int = 1) -> int:
        """Pages `tokens` more tokens for each of `requests` (all holding rows) allocate, copy-on-write included."""
        rows = [r.seat.row for r in requests]
        if any(row is None for row in rows):
            raise ValueError("every decoding request must hold a cache row")
        return self.cache.pages_needed_to_append(torch.tensor(rows), tokens)

    def fits_in_empty_pool(self, num_tokens: int) -> bool:
        """Whether `num_tokens` uncompressed entries in every (layer, KV head) fit in the whole pool."""
        return self.cache.pages_for_prompt(num_tokens) <= self.cache.pool.num_pages

    def prefill_reservation(self, request: Request, first_chunk_end: int, chunk_tokens: int | None = None) -> int:
        """Pages to reserve for the request's prefill if its first chunk ends at `first_chunk_end`.

        The full prompt, or the policy's declared peak when the whole prefill is one layer-wise chunk,
        or, for a write-gated request whose chunks are at most `chunk_tokens`, its chunked prefill peak
        (`layerwise.prefill_reservation`); the layer-wise prefill and the chunk-boundary WG-KV admission
        limit (`PromptAdmission.drop_unadmitted`) hold the request to the same figure. On a model with
        sliding-window layers (which hold at most their window, and never compress layer by layer) it is the
        prompt as the cache holds it.
        """
        if self.cache.has_sliding_layers:
            return self.cache.pages_for_prompt(request.prefill_target)
        return prefill_reservation(
            request.policy,
            request.prefill_target,
            first_chunk_end == request.prefill_target,
            self.config.num_hidden_layers,
            self.config.num_key_value_heads,
            self.cache.page_size,
            request.seat.admission is not None,
            chunk_tokens if request.seat.admission is not None else None,
        )

    # ------------------------------------------------------------------ stepping

    @torch.no_grad()  # not inference_mode: cache tables grown inside a step are mutated outside it later
    def execute(self, schedule: Schedule) -> RunnerOutput:
        """Run the schedule's prefill chunks, then its decodes; advance each request's `num_processed`."""
        output = RunnerOutput()
        sampled: list[tuple[Request, torch.Tensor]] = []
        if schedule.prefill:
            sampled += self._run_prefill(schedule.prefill, output.failed)
        if schedule.decode:
            sampled += self._run_decode(schedule.decode, output.failed)
        failed = {id(f.request) for f in output.failed}
        sampled = [(r, h) for r, h in sampled if id(r) not in failed]
        if sampled:
            output.sample = [r for r, _ in sampled]
            output.logits = self.model.compute_logits(torch.stack([h for _, h in sampled]))
        return output

    def _run_prefill(self, chunks: list[ScheduledChunk], failed: list[RequestFailure]) -> list[tuple[Request, Any]]:
        segments: list[PrefillSegment] = []
        running: list[ScheduledChunk] = []
        token_ids: list[int] = []
        positions: list[int] = []
        layerwise: dict[str, LayerwiseCompression] = {}
        for chunk in chunks:
            req = chunk.request
            assert req.seat.row is not None
            compression = None
            try:
                # A prompt tail after compression (`runs_tail_as_chunk`) captures nothing: the policy is done.
                capture = None if req.status is RequestStatus.RUNNING else self._capture_for(req)
                if self._compresses_layerwise(req, chunk):
                    assert req.policy is not None
                    compression = LayerwiseCompression(
                        self.cache,
                        req.policy,
                        req.request_id,
                        req.seat.row,
                        chunk.start,
                        chunk.end,
                        self.config.num_attention_heads,
                        functools.partial(self.layer_prefill, req),
                        self.clock,
                    )
                    req.seat.policy_state = compression.state
                    slots = None  # allocated layer by layer inside the forward pass
                else:
                    slots = self.cache.append_slots([req.seat.row], torch.arange(chunk.start, chunk.end).view(1, -1))
            except Exception as exc:
                failed.append(RequestFailure(req, exc))
                continue
            if compression is not None:
                layerwise[req.request_id] = compression
            if req.seat.admission is not None and chunk.start == 0:
                assert isinstance(req.policy, AdmissionPolicy)
                req.seat.prompt_admission = PromptAdmission(
                    req.seat.admission, req.policy, self.config.num_hidden_layers
                )
            segments.append(
                PrefillSegment(
                    req.seat.row,
                    chunk.start,
                    chunk.end,
                    len(token_ids),
                    slots,
                    capture,
                    req.seat.prompt_admission,
                    compression,
                )
            )
            running.append(chunk)
            token_ids += req.all_token_ids[chunk.start : chunk.end]
            positions += range(chunk.start, chunk.end)
        if not running:
            return []
        ids = torch.tensor(token_ids, device=self.device)
        pos_t = torch.tensor(positions, device=self.device)
        hidden = self.model(ids, pos_t, PrefillContext(self.cache, segments, pos_t, self.scale))
        sampled: list[tuple[Request, Any]] = []
        for chunk, segment in zip(running, segments, strict=True):
            req = chunk.request
            req.seat.num_processed = chunk.end
            compression = layerwise.get(req.request_id)
            try:
                if compression is not None and compression.error is not None:
                    raise compression.error
                if chunk.end == req.prefill_target:
                    self.complete_prefill(req, compression)
                elif req.seat.prompt_admission is not None:
                    req.seat.prompt_admission.drop_unadmitted(self.cache, req.request_id)
            except Exception as exc:
                failed.append(RequestFailure(req, exc))
                continue
            self._record_prompt_logprobs(req, chunk.start, hidden[segment.offset : segment.offset + segment.length])
            if chunk.end == req.num_tokens:
                sampled.append((req, hidden[segment.offset + segment.length - 1]))
        return sampled

    def _run_decode(self, requests: list[Request], failed: list[RequestFailure]) -> list[tuple[Request, Any]]:
        positions = torch.tensor([[r.seat.num_processed] for r in requests])
        try:
            slots = self.cache.append_slots(torch.tensor([r.seat.row for r in requests]), positions)
        except PoolExhaustedError:
            requests, slots = self._append_what_fits(requests, failed)
            if not requests:
                return []
            positions = torch.tensor([[r.seat.num_processed] for r in requests])
        rows = torch.tensor([r.seat.row for r in requests])
        tokens = torch.tensor([r.token_at(r.seat.num_processed) for r in requests], device=self.device)
        want_probs = any(r.policy is not None and r.policy.wants_decode_attention for r in requests)
        context = DecodeContext(self.cache, rows, slots, self.scale, want_probs, self._admission_groups(requests))
        hidden = self.model(tokens, positions.view(-1).to(self.device), context)
        sampled: list[tuple[Request, Any]] = []
        for i, r in enumerate(requests):
            self._record_prompt_logprobs(r, r.seat.num_processed, hidden[i : i + 1])
            r.seat.num_processed += 1
            if r.policy is not None and r.policy.wants_decode_steps:
                try:
                    self._on_decode_step(r, i, context)
                except Exception as exc:
                    failed.append(RequestFailure(r, exc))
                    continue
            if r.seat.num_processed == r.num_tokens:
                sampled.append((r, hidden[i]))
        return sampled

    def _record_prompt_logprobs(self, request: Request, first_position: int, hidden: torch.Tensor) -> None:
        """Prompt log-probabilities from the hidden states at positions `first_position...` (`prompt_logprobs`).

        The state at position p predicts prompt token p + 1, from what the cache held when the prompt was
        written: before compression for everything the prefill runs, and from the compressed cache for
        prompt tokens after a `compress_after` point. A recompute after preemption reproduces positions
        already recorded; they are kept, not appended twice.
        """
        k = request.params.prompt_logprobs
        if k is None:
            return
        prompt = request.prompt_token_ids
        if not request.prompt_logprobs:
            request.prompt_logprobs.append(None)  # nothing predicts the first token
        start = len(request.prompt_logprobs) - 1
        stop = min(first_position + hidden.shape[0], len(prompt) - 1)
        if not first_position <= start < stop:
            return
        logits = self.model.compute_logits(hidden[start - first_position : stop - first_position])
        request.prompt_logprobs.extend(token_logprobs(logits, prompt[start + 1 : stop + 1], k))

    def _append_what_fits(
        self, requests: list[Request], failed: list[RequestFailure]
    ) -> tuple[list[Request], torch.Tensor]:
        """The batch's pages did not fit: keep the earliest requests whose pages do, fail the rest.

        The driver's scheduler counts every page a step needs, so this only runs when a request
        outgrew what it was budgeted (e.g. a policy that holds more than it reported).
        """
        kept: list[Request] = []
        free = self.cache.pool.num_free
        for r in requests:
            need = self.cache.pages_needed_to_append(torch.tensor([r.seat.row]), 1)
            if need <= free:
                kept.append(r)
                free -= need
            else:
                failed.append(RequestFailure(r, PoolExhaustedError(need, free)))
        if not kept:
            return [], torch.empty(0)
        positions = torch.tensor([[r.seat.num_processed] for r in kept])
        return kept, self.cache.append_slots(torch.tensor([r.seat.row for r in kept]), positions)

    @staticmethod
    def _admission_groups(requests: list[Request]) -> list[tuple[torch.Tensor, Admission]]:
        """Batch indices of the requests sharing each write gate, so each gate runs once per layer."""
        groups: dict[int, tuple[list[int], Admission]] = {}
        for i, r in enumerate(requests):
            if r.seat.admission is not None:
                groups.setdefault(id(r.seat.admission), ([], r.seat.admission))[0].append(i)
        return [(torch.tensor(index), admission) for index, admission in groups.values()]

    def _capture_for(self, request: Request) -> PrefillCapture | None:
        """The request's capture, created on its first chunk; None (no work at all) without a policy."""
        if request.policy is None:
            return None
        if request.seat.capture is None:
            spec = request.policy.capture_spec()
            if spec.empty:
                return None
            request.seat.capture = PrefillCapture(spec, self.config.num_hidden_layers, self.model.rotary)
        return request.seat.capture

    def _compresses_layerwise(self, request: Request, chunk: ScheduledChunk) -> bool:
        """Layer-wise compression runs on the chunk that completes the prefill, if the policy opts in.

        Earlier chunks write every layer as usual (the policy must see the whole prompt of a layer),
        so the prefill peak falls from the whole prompt in every layer to the earlier chunks' prefix
        in every layer plus, for this chunk, one layer whole and the others compressed. Requests with
        a write gate (WG-KV) keep the end-of-prefill path: their prompt goes through `start_ring`; so do
        models with sliding-window layers, whose rings never hold a whole prompt to compress.
        """
        policy = request.policy
        return bool(
            policy is not None
            and policy.compresses_layerwise
            and not self.cache.has_sliding_layers
            and request.seat.admission is None
            and chunk.end == request.prefill_target
        )

    # ------------------------------------------------------------------ policy hooks

    def layer_prefill(self, request: Request, layer: int, gated: bool = False) -> LayerPrefill:
        """What a policy sees of one layer after prefill (`engine/compression.py`)."""
        return layer_prefill(self.cache, request.request_id, layer, request.seat.capture, self.model, self.scale, gated)

    def complete_prefill(self, request: Request, layerwise: LayerwiseCompression | None = None) -> None:
        """Prefill reached `prefill_target`: the policy scores every layer, plans, and the cache compacts.

        `execute` calls this when a chunk ends at `prefill_target`. A caller that filled a request's
        cache itself (its first `num_processed` entries written, its capture set, e.g. a copy of a
        shared prefix: `engine/prefix.py`) calls it to compress and start decoding the same way.
        With `layerwise`, every layer was already compressed during the forward pass.
        """
        request.status = RequestStatus.RUNNING
        request.seat.compressed_at = request.seat.num_processed
        policy = request.policy
        if layerwise is not None:  # every layer was compressed in the pass: drop the captures, count the time
            request.seat.capture = None
            request.seat.kv.compression_seconds += layerwise.seconds
        elif policy is not None:
            self.update_kv_stats(request)  # the uncompressed peak
            if self.prefix_store is not None:  # its exact prompt, for later prompts that share its tokens
                self.prefix_store.store_prompt(request)
            start = self.clock()
            # KVzip's scores come from a second forward pass over the cached prompt (engine/reconstruction.py).
            score_by_reconstruction(self, request)
            state: dict[str, Any] = {}
            request.seat.policy_state = state
            gated = request.seat.admission is not None
            if gated:
                assert request.seat.prompt_admission is not None
                request.seat.prompt_admission.start_ring(self.cache, request.request_id)
                request.seat.prompt_admission = None
            compress_prefill(
                self.cache,
                request.request_id,
                policy,
                request.seat.capture,
                num_q_heads=self.config.num_attention_heads,
                length=request.seat.num_processed,
                model=self.model,
                scale=self.scale,
                state=state,
                gated=gated,
                make_room=self._evicted_a_cached_prefix,
            )
            request.seat.capture = None
            request.seat.kv.compression_seconds += self.clock() - start
        self.update_kv_stats(request)
        if policy is not None and request.params.return_kept:  # before any later token enters the cache
            request.seat.kv.kept_at_compression = kept_entries(self.cache, request.request_id)
        if self.prefix_store is not None:
            self.prefix_store.store(request)

    def _on_decode_step(self, request: Request, batch_index: int, context: DecodeContext) -> None:
        """Let the request's policy evict after a decode step (e.g. H2O, bounded StreamingLLM)."""
        assert request.policy is not None and request.seat.row is not None
        start = self.clock()

        def attention(layer: int, entries: int) -> torch.Tensor | None:
            if context.probs is None:
                return None
            return context.host_probs(layer)[batch_index, :, :, :entries]

        position = request.seat.num_processed - 1
        evict_after_decode(
            self.cache, request.request_id, request.policy, request.seat.policy_state, position, attention
        )
        request.seat.kv.compression_seconds += self.clock() - start

    def record_kept(self, request: Request) -> None:
        """Set `request.seat.kv.kept`: the positions every (layer, KV head) holds now (before its row is freed)."""
        request.seat.kv.kept = kept_entries(self.cache, request.request_id)

    def update_kv_stats(self, request: Request) -> None:
        """Refresh `request.seat.kv` from the pool's own accounting (the request must hold a cache row)."""
        usage = self.cache.usage(request.request_id)
        kv = request.seat.kv
        kv.tokens_kept = usage.tokens
        kv.tokens_full = self.config.num_hidden_layers * self.config.num_key_value_heads * request.seat.num_processed
        kv.kv_bytes = usage.bytes
        # The cache's high-water mark is exact (updated at every allocation, layer-wise prefill included);
        # the max keeps the peak of an earlier life of a preempted request.
        peak = self.cache.peak_pages(request.request_id) * self.cache.pool.bytes_per_page
        kv.kv_bytes_peak = max(kv.kv_bytes_peak, usage.bytes, peak)
        per_head = usage.global_tokens + usage.ring_tokens
        kv.kept_per_head = per_head.tolist()
        kv.mean_kept_per_layer = (per_head.sum(-1) // per_head.shape[-1]).tolist()
        if isinstance(request.seat.policy_state, dict):
            kv.counters = dict(request.seat.policy_state.get("counters", {}))
