"""Prefill-first continuous batching: requests start by free pages and are preempted by recompute.

Vocabulary: the scheduler *starts* a waiting request (gives it a cache row and reserves its prefill);
"admission" is reserved for a write gate's decision to keep a token (WG-KV), as in its paper.

Each step is either a prefill step or a decode step:

- Prefill: chunks of started-but-unfinished prompts, then newly started requests, up to
  `max_num_batched_tokens` tokens. A waiting request starts only when its prefill peak fits in
  what is free after the pages already promised to unfinished prefills. The peak is the whole
  prompt in every layer and head, except for a prefill that compresses layer by layer in one chunk:
  then it is what the policy declares (`KVPolicy.prefill_peak_pages`), and the engine fails the
  request alone if it ever needs more, so a wrong declaration cannot take another request's pages;
  and except for an admission policy (WG-KV) that keeps only admitted tokens past each chunk of at
  most `max_num_batched_tokens`: then its `chunked_prefill_peak_pages`.
- Decode: one token for every running request. If the pool cannot take the step, the most
  recently started request is preempted: its pages are freed and it goes back to the front of
  the queue to be recomputed later (prompt and generated tokens alike), never dropped.

- Cached compressed prefixes (`engine/prefix_store.py`): a waiting request whose context is cached
  attaches to it instead of prefilling (no pages, no reservation); entries no running request is
  attached to are dropped, least recently used first, before a running request is preempted and
  before a waiting prefill is refused for lack of pages.

Every page a step needs is counted before the step runs, so the forward pass never meets a full pool.
The scheduler only decides; the `ModelRunner` it is given owns the cache rows it hands out and frees.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vllm_kvpress_ext.engine.model_runner import ModelRunner, Schedule, ScheduledChunk
from vllm_kvpress_ext.engine.origins import MatchedPrefix
from vllm_kvpress_ext.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput(Schedule):
    """The runner's `Schedule`, plus the requests preempted to make room for it."""

    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # PREFILLING or RUNNING, in the order they started

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def adopt(self, request: Request) -> None:
        """A request given its cache row without being started here (a fork of another request's cache, a copy
        of a prefilled prefix) joins the started set as if it had started now."""
        if request.seat.row is None or request.status not in (RequestStatus.PREFILLING, RequestStatus.RUNNING):
            raise ValueError(f"request {request.request_id!r} must hold a cache row to be adopted")
        self.active.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.active)

    @property
    def has_room(self) -> bool:
        """Whether one more request may start (`max_num_seqs`)."""
        return len(self.active) < self.max_num_seqs

    def _pages_promised(self) -> int:
        """Pages that unfinished prefills may still allocate: their reservation less what they hold."""
        promised = 0
        for req in self.active:
            if req.status is RequestStatus.PREFILLING:
                promised += max(0, req.reserved_pages - self.runner.pages_held(req))
        return promised

    def schedule(self) -> SchedulerOutput:
        prefill = self._schedule_prefill()
        if prefill:
            return SchedulerOutput(prefill=prefill, decode=[], preempted=[])
        preempted: list[Request] = []
        while True:
            running = [r for r in self.active if r.status is RequestStatus.RUNNING]
            if not running:
                return SchedulerOutput(prefill=[], decode=[], preempted=preempted)
            if self.runner.pages_to_decode(running) <= self.runner.free_pages:
                return SchedulerOutput(prefill=[], decode=running, preempted=preempted)
            # Cached prefixes nobody runs on go first; a running request is preempted only after them.
            if self.runner.evict_cached_prefix() is None:
                preempted.append(self.preempt(self.active[-1]))

    def _schedule_prefill(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        free = self.runner.free_pages
        for req in self.active:
            if req.status is not RequestStatus.PREFILLING or budget == 0:
                continue
            end = min(req.prefill_target, req.seat.num_processed + budget)
            chunks.append(ScheduledChunk(req, req.seat.num_processed, end))
            budget -= end - req.seat.num_processed
        available = free - self._pages_promised()
        for req in self.active:  # prompt tails after compression, one chunk each where the pages are there
            if budget <= 0 or not self.runner.runs_tail_as_chunk(req):
                continue
            end = min(req.num_tokens, req.seat.num_processed + budget)
            pages = self.runner.pages_to_decode([req], end - req.seat.num_processed)
            if pages > available:
                continue  # the tail goes on as decode steps
            chunks.append(ScheduledChunk(req, req.seat.num_processed, end))
            budget -= end - req.seat.num_processed
            available -= pages
        while self.waiting and len(self.active) < self.max_num_seqs:
            req = self.waiting[0]
            if self.runner.start(req, MatchedPrefix()):
                if req.status is RequestStatus.RUNNING:  # a cached compressed prefix: no prefill, no reservation
                    self.waiting.popleft()
                    self.active.append(req)
                    continue
                # An exact cached prefix: the request's own prefill goes on after it, and its policy compresses
                # at the end as usual; the pages it reads are held already, its reservation covers the rest.
                reservation = self.runner.attached_prefill_reservation(req)
                need = reservation - self.runner.pages_held(req)
                available = self._evict_for(need, available)
                if need > available:
                    self.runner.detach_prefix(req)
                    break
                self.waiting.popleft()
                self.active.append(req)
                req.reserved_pages = reservation
                available -= need
                if budget > 0:
                    end = min(req.prefill_target, req.seat.num_processed + budget)
                    chunks.append(ScheduledChunk(req, req.seat.num_processed, end))
                    budget -= end - req.seat.num_processed
                continue
            if budget <= 0:
                break
            end = min(req.prefill_target, budget)
            peak = self.runner.prefill_reservation(req, end, self.max_num_batched_tokens)
            available = self._evict_for(peak, available)
            if peak > available:
                break
            self.waiting.popleft()
            self.runner.start(req)
            self.active.append(req)
            req.reserved_pages = peak
            available -= peak
            chunks.append(ScheduledChunk(req, 0, end))
            budget -= end
        return chunks

    def _evict_for(self, pages: int, available: int) -> int:
        """Drop unused cached prefixes, least recently used first, until `pages` are available (or none is
        left to drop); return the pages available then."""
        while pages > available:
            freed = self.runner.evict_cached_prefix()
            if freed is None:
                break
            available += freed
        return available

    def preempt(self, request: Request) -> Request:
        """Free the request's pages and queue it for recomputation ahead of everything else."""
        if request in self.active:
            self.active.remove(request)
        self.runner.preempt(request)
        self.waiting.appendleft(request)
        return request

    def finish(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        else:
            self._release(request)
        request.status = RequestStatus.FINISHED

    def _release(self, request: Request) -> None:
        self.runner.release(request)
        if request in self.active:
            self.active.remove(request)
