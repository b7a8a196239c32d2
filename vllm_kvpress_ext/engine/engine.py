"""`LLMEngine`: requests in, one scheduled step at a time, outputs out.

The step API (`add_request`, `step`, `abort`) is what the HTTP server drives; `LLM` wraps it for
offline batch generation. The engine is the embedded driver of `ModelRunner`: its `Scheduler`
decides each step, the runner executes it, and the engine samples, applies stops and reports.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.engine.model_runner import DEFAULT_KV_MEMORY, ModelRunner, RequestFailure
from vllm_kvpress_ext.engine.origins import ForkOf
from vllm_kvpress_ext.engine.request import Request, RequestOutput, RequestRejectedError
from vllm_kvpress_ext.engine.sampler import record_logprobs, sample
from vllm_kvpress_ext.engine.samples import can_share
from vllm_kvpress_ext.engine.sampling_params import SamplingParams
from vllm_kvpress_ext.engine.scheduler import Scheduler, SchedulerOutput
from vllm_kvpress_ext.engine.stats import EngineStats, StepKind
from vllm_kvpress_ext.models import load_tokenizer
from vllm_kvpress_ext.policies import KVPolicy, load_policy
from vllm_kvpress_ext.policies.base import LayerPrefill

__all__ = ["DEFAULT_KV_MEMORY", "LLMEngine", "RequestRejectedError"]

logger = logging.getLogger(__name__)

PolicySpec = str | Path | dict[str, Any] | KVPolicy


class LLMEngine:
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
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        kv_dtype: torch.dtype | str | None = None,
        kv_policy: PolicySpec | None = None,
        enable_prefix_caching: bool = False,
        max_cached_prefixes: int = 16,
        prefix_matching: str = "named",
        exact_prompt_reuse: bool = True,
    ) -> None:
        """`enable_prefix_caching` keeps up to `max_cached_prefixes` compressed contexts (requests with a
        context/question boundary, `compress_after` < prompt length) for later requests with the same
        context, policy and model to attach to instead of prefilling (`engine/prefix_store.py`), and the
        caches of finished uncompressed requests, which any later uncompressed prompt sharing their first
        tokens reuses exactly. With `exact_prompt_reuse` (the default) a compressing request also keeps its
        prompt's exact cache, taken just before its policy compresses, and reads the tokens it shares with
        such an entry before the first position its policy needs its own prefill to compute
        (`KVPolicy.reusable_prefix`): a shared system prompt is prefilled once for every policy.

        `prefix_matching="auto"` (opt-in: it changes what a compressing policy sees) also attaches
        requests that name no context to the longest stored prefix of their prompt, and keeps each
        finished request's cache for a later turn that extends it (docs/prefix_reuse.md)."""
        if max_cached_prefixes < 1:
            raise ValueError(f"max_cached_prefixes must be >= 1, got {max_cached_prefixes}")
        self.default_policy = load_policy(kv_policy)
        self.runner = ModelRunner(
            model_dir,
            dtype=dtype,
            device=device,
            num_pages=num_pages,
            kv_memory=kv_memory,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            kv_dtype=kv_dtype,
            max_cached_prefixes=max_cached_prefixes if enable_prefix_caching else 0,
            prefix_matching=prefix_matching,
            exact_prompt_reuse=exact_prompt_reuse,
        )
        self.model_dir = self.runner.model_dir
        self.device = self.runner.device
        self.model = self.runner.model
        self.config = self.runner.config
        self.dtype = self.runner.dtype
        self.cache = self.runner.cache
        self.scale = self.runner.scale
        self.tokenizer = load_tokenizer(self.model_dir)
        self.max_model_len = min(
            max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings
        )
        self.scheduler = Scheduler(self.runner, max_num_seqs, max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self._samples: dict[str, list[Request]] = {}  # request id -> samples waiting for its prompt (samples.py)
        self._finishing: list[Request] | None = None  # while a step samples: finished requests to release
        self._ids = itertools.count()
        self.eos_token_ids = set(self.config.eos_token_ids)
        # Called with each request as it finishes, while its entries are still in the cache (for reading
        # more than `SamplingParams(return_kept=True)` returns, e.g. the K/V of a shared prefix).
        self.finish_hooks: list[Callable[[Request], None]] = []
        self._plan: SchedulerOutput | None = None  # the plan of the step running (or last run)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        compress_after: int | None = None,
        policy: PolicySpec | None = None,
        sample_of: str | None = None,
        context_is_fallback: bool = False,
    ) -> str:
        """Queue a request; `policy` overrides the engine's default (`"full"` turns compression off).

        `compress_after` (default: the whole prompt) is how many prompt tokens are prefilled before
        the policy compresses; the rest of the prompt then runs from the
        compressed cache (the strict and question-agnostic evaluation protocols).

        `sample_of` names a request with the same prompt, policy and `compress_after` whose compressed
        prompt this one starts from instead of prefilling its own (another sample of one prompt,
        `samples.py`); where that cannot be, it runs on its own with the same result.

        `context_is_fallback` makes `compress_after` a default that automatic prefix matching may
        override with a stored prefix's boundary (chat's "every message but the last").
        """
        params = params or SamplingParams()
        resolved = self.default_policy if policy is None else load_policy(policy)
        if resolved is not None and not resolved.compresses:
            resolved = None
        token_ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.runner.new_request(
            request_id, token_ids, params, resolved, max_model_len=self.max_model_len, compress_after=compress_after
        )
        request.context_is_fallback = context_is_fallback and compress_after is not None
        self.requests[request_id] = request
        parent = self.requests.get(sample_of) if sample_of is not None else None
        if parent is not None and can_share(parent, request):
            self._samples.setdefault(parent.request_id, []).append(request)
        else:
            self.scheduler.add(request)
        return request_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens=False` for text that continues a prompt (no BOS)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer; pass token ids instead of text")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and return its pages to the pool."""
        request = self.requests.pop(request_id, None)
        if request is None or request.finished:
            return
        for waiting in self._samples.values():
            if request in waiting:
                waiting.remove(request)
                self.scheduler.finish(request)  # it holds nothing yet
                request.finish_reason = "abort"
                return
        self._release_samples(request)
        self.scheduler.finish(request)
        request.finish_reason = "abort"

    def _release_samples(self, request: Request) -> None:
        """The request ends before its first token: the samples waiting on it prefill on their own."""
        for waiting in self._samples.pop(request.request_id, []):
            self.scheduler.add(waiting)

    def _fork_samples(self, parent: Request) -> list[Request]:
        """Start the samples waiting on `parent` (at its first sampled token) from its cache; those that find
        no row or page run on their own instead."""
        forked = []
        for child in self._samples.pop(parent.request_id, []):
            if not self.scheduler.has_room or not self.runner.start(child, ForkOf(parent)):
                self.scheduler.add(child)
                continue
            self.scheduler.adopt(child)
            forked.append(child)
        return forked

    def adopt_prefilled(self, request: Request) -> None:
        """Run a request whose prompt prefix the runner already holds (`origins.LoadedEntries`): it joins the
        running set, and its policy compresses now, as at the end of its own prefill (`engine/prefix.py`)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.adopt(request)
        self.runner.complete_prefill(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------ what callers may read

    @property
    def num_waiting(self) -> int:
        """Requests queued to start (cheap; `stats()` has everything)."""
        return len(self.scheduler.waiting)

    def stats(self) -> EngineStats:
        """The pool, the queues and the last step as of now (between steps)."""
        pool = self.cache.pool
        plan = self._plan
        last_step: StepKind = "idle" if plan is None or plan.empty else "prefill" if plan.prefill else "decode"
        return EngineStats(
            pages_total=pool.num_pages,
            pages_used=pool.num_used,
            pages_free=pool.num_free,
            page_bytes=pool.bytes_per_page,
            page_size=self.cache.page_size,
            running=len(self.scheduler.active),
            waiting=len(self.scheduler.waiting),
            last_step=last_step,
            prefixes=self.runner.prefix_store_stats(),
        )

    def requests_in_last_step(self) -> list[str]:
        """Ids of the requests the last step, or the step that just raised, may have touched.

        The step's own batch (prefill chunks, or decodes) when it got as far as planning; otherwise (it
        failed while scheduling) every unfinished request except those cleanly queued to start, which
        hold no pages. Requests the step preempted went back to the queue intact and are not listed.
        """
        plan = self._plan
        if plan is not None:
            batch = [c.request for c in plan.prefill] if plan.prefill else list(plan.decode)
            return [r.request_id for r in batch]
        waiting = {r.request_id for r in self.scheduler.waiting}
        touched = [rid for rid in self.requests if rid not in waiting]
        return touched + [r.request_id for r in self.scheduler.active]

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return a snapshot of every request that produced a token or finished."""
        self._plan = None
        plan = self.scheduler.schedule()
        # Kept so that a caller whose step raised knows which requests the failed batch held.
        self._plan = plan
        # A preempted request that could not take another token even in an empty pool ends here
        # (with "length": it ran out of room), and is reported like any other finished request.
        touched = [r for r in plan.preempted if self._stop_if_pool_too_small(r)]
        if not plan.empty:
            result = self.runner.execute(plan)
            for failure in result.failed:
                self._fail(failure)
            touched += [f.request for f in result.failed]
            if result.logits is not None:
                touched += self._append_tokens(result.sample, result.logits)
        return [self._snapshot(r) for r in touched]

    def _stop_if_pool_too_small(self, request: Request) -> bool:
        if self.runner.fits_in_empty_pool(request.num_tokens + 1):
            return False
        self._finish(request, "length")
        return True

    def _fail(self, failure: RequestFailure) -> None:
        """The runner could not complete this request's step: it ends alone, with its pages freed."""
        logger.warning("request %s failed in its policy work", failure.request.request_id, exc_info=failure.error)
        failure.request.error = failure.message
        self._finish(failure.request, "error")

    def layer_prefill(self, request: Request, layer: int, gated: bool = False) -> LayerPrefill:
        """What a policy sees of one layer after prefill (see `ModelRunner.layer_prefill`)."""
        return self.runner.layer_prefill(request, layer, gated)

    # ------------------------------------------------------------------ outputs

    def _append_tokens(self, requests: list[Request], logits: torch.Tensor) -> list[Request]:
        if self._samples:  # samples waiting for one of these prompts start here, on the same logits
            rows = list(range(len(requests)))
            for i, request in enumerate(list(requests)):
                if not request.output_token_ids and request.request_id in self._samples:
                    forked = self._fork_samples(request)
                    requests = requests + forked
                    rows += [i] * len(forked)
            logits = logits[rows] if len(rows) > logits.shape[0] else logits
        tokens = sample(logits, requests, self.eos_token_ids)
        record_logprobs(requests, logits, tokens)
        now = time.monotonic()
        # Rows of requests finishing in this step are released together, after every one of them has
        # read its KV figures: samples sharing pages then all see the same holders (one share each).
        self._finishing = []
        try:
            for request, token in zip(requests, tokens, strict=True):
                request.output_token_ids.append(token)
                if request.first_token_time is None:
                    request.first_token_time = now
                self._check_stop(request, token)
        finally:
            finishing, self._finishing = self._finishing, None
            for request in finishing:
                self.scheduler.finish(request)
        return requests

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.params
        if not params.ignore_eos and token in self.eos_token_ids:
            self._finish(request, "stop", token)
            return
        if token in params.stop_token_ids:
            self._finish(request, "stop", token)
            return
        if params.stop and self.tokenizer is not None:
            text = request.output_text(self.tokenizer)
            for stop in params.stop:
                index = text.find(stop)
                if index >= 0:
                    request.text = text[:index]
                    self._finish(request, "stop", stop)
                    return
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        if request.seat.row is not None:
            self.runner.update_kv_stats(request)
            if request.params.return_kept and reason != "error":  # read before `scheduler.finish` frees the row
                self.runner.record_kept(request)
            if reason != "error":
                for hook in self.finish_hooks:
                    hook(request)
                self.runner.keep_session(request)
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self._release_samples(request)
        if self._finishing is not None:
            self._finishing.append(request)
        else:
            self.scheduler.finish(request)
        if self.tokenizer is not None and not isinstance(stop_reason, str):
            ids = request.output_token_ids
            if stop_reason is not None:
                ids = ids[:-1]
            request.text = self.tokenizer.decode(ids, skip_special_tokens=request.params.skip_special_tokens)
        self.requests.pop(request.request_id, None)

    def _snapshot(self, request: Request) -> RequestOutput:
        text = request.text
        if not request.finished and self.tokenizer is not None:
            text = request.output_text(self.tokenizer)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            text=text,
            finished=request.finished,
            finish_reason=request.finish_reason,
            kv=dataclasses.replace(
                request.seat.kv,
                mean_kept_per_layer=list(request.seat.kv.mean_kept_per_layer),
                counters=dict(request.seat.kv.counters),
            ),
            num_preemptions=request.num_preemptions,
            error=request.error,
            logprobs=list(request.output_logprobs) if request.params.logprobs is not None else None,
            prompt_logprobs=list(request.prompt_logprobs) if request.params.prompt_logprobs is not None else None,
            cached_tokens=request.seat.cached_tokens,
        )
