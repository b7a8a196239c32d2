"""`LLMEngine`: requests in, one scheduled step at a time, outputs out.

The step API (`add_request`, `step`, `abort`) is what the HTTP server drives; `LLM` wraps it for
offline batch generation. The engine is the embedded driver of `ModelRunner`: its `Scheduler`
decides each step, the runner executes it, and the engine samples, applies stops and reports.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.cache import PoolExhaustedError, RequestCapacityError
from vllm_kvpress_ext.engine.kept import kept_entries
from vllm_kvpress_ext.engine.model_runner import DEFAULT_KV_MEMORY, ModelRunner, RequestFailure
from vllm_kvpress_ext.engine.request import Request, RequestOutput, RequestStatus
from vllm_kvpress_ext.engine.sampler import record_logprobs, sample
from vllm_kvpress_ext.engine.sampling_params import SamplingParams
from vllm_kvpress_ext.engine.scheduler import Scheduler, SchedulerOutput
from vllm_kvpress_ext.models import load_tokenizer
from vllm_kvpress_ext.policies import KVPolicy, load_policy
from vllm_kvpress_ext.policies.base import Admission, LayerPrefill

__all__ = ["DEFAULT_KV_MEMORY", "LLMEngine", "RequestRejectedError"]

logger = logging.getLogger(__name__)

PolicySpec = str | Path | dict[str, Any] | KVPolicy


class RequestRejectedError(ValueError):
    """The request can never run on this engine (too long for the model or for the whole pool)."""


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
    ) -> None:
        """`enable_prefix_caching` keeps up to `max_cached_prefixes` compressed contexts (requests with a
        context/question boundary, `compress_after` < prompt length) for later requests with the same
        context, policy and model to attach to instead of prefilling (`engine/prefix_store.py`)."""
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
        self._ids = itertools.count()
        self.eos_token_ids = set(self.config.eos_token_ids)
        # Called with each request as it finishes, while its entries are still in the cache (for reading
        # more than `SamplingParams(return_kept=True)` returns, e.g. the K/V of a shared prefix).
        self.finish_hooks: list[Callable[[Request], None]] = []
        self.last_plan: SchedulerOutput | None = None  # the plan of the step running (or last run)
        # Samples waiting for their first sample's prompt: forked from it when it samples its first token.
        self._pending_samples: dict[str, list[Request]] = {}
        self.samples_forked = 0  # samples that started from another sample's cache instead of a prefill

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
    ) -> str:
        """Queue a request; `policy` overrides the engine's default (`"full"` turns compression off).

        `compress_after` (default: the whole prompt) is how many prompt tokens are prefilled before
        the policy compresses; the rest of the prompt then runs through decode steps from the
        compressed cache (the strict and question-agnostic evaluation protocols).

        `sample_of` names another request with the same prompt, policy and `compress_after` (an earlier
        sample of the same prompt, as in `n` > 1): if that request has not sampled its first token yet,
        this one is not prefilled but starts from a fork of its compressed cache when it does (pages
        shared, copy-on-write), so n samples hold one compressed prompt plus n tails. Otherwise, or if
        the fork cannot be made then, it runs alone. Either way its tokens are those it would produce alone.
        """
        params = params or SamplingParams()
        resolved = self.default_policy if policy is None else load_policy(policy)
        if resolved is not None and not resolved.compresses:
            resolved = None
        token_ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not token_ids:
            raise RequestRejectedError("the prompt is empty")
        vocab = self.config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise RequestRejectedError(f"prompt token ids must lie in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise RequestRejectedError(
                f"prompt has {len(token_ids)} tokens; the model's limit is {self.max_model_len} (prompt + output)"
            )
        if compress_after is not None and (not isinstance(compress_after, int) or isinstance(compress_after, bool)):
            raise TypeError(f"compress_after must be an integer or None, got {compress_after!r}")
        if compress_after is not None and not 0 < compress_after <= len(token_ids):
            raise RequestRejectedError(f"compress_after must lie in [1, {len(token_ids)}], got {compress_after}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        leader = self._sample_leader(sample_of, token_ids, compress_after, resolved, params)
        request = Request(request_id, token_ids, params, compress_after=compress_after, policy=resolved)
        # The last sampled token is never written to the cache: prompt + max_tokens - 1 entries at most.
        request.admission = self._admission_for(resolved, len(token_ids) + params.max_tokens - 1)
        if leader is not None and getattr(leader.admission, "window", None) != getattr(
            request.admission, "window", None
        ):
            leader = None  # a write gate's ring is sized by max_tokens: another ring, another cache
        peak = self.cache.pages_for_prompt(request.prefill_target)
        if peak > self.cache.pool.num_pages:
            raise RequestRejectedError(
                f"prompt needs {peak} KV pages before compression but the whole pool has {self.cache.pool.num_pages}"
            )
        self.requests[request_id] = request
        if leader is not None:
            self._pending_samples.setdefault(leader.request_id, []).append(request)
        else:
            self.scheduler.add(request)
        return request_id

    def _sample_leader(
        self,
        sample_of: str | None,
        token_ids: list[int],
        compress_after: int | None,
        policy: KVPolicy | None,
        params: SamplingParams,
    ) -> Request | None:
        """The request a new sample can fork from at its first token, or None to run the sample alone."""
        if sample_of is None:
            return None
        leader = self.requests.get(sample_of)
        if leader is None or leader.finished or leader.output_token_ids or leader.num_preemptions:
            return None
        if leader.prompt_token_ids != token_ids or leader.compress_after != compress_after:
            raise ValueError(f"sample_of={sample_of!r} names a request with another prompt or compress_after")
        if leader.policy is not policy and repr(leader.policy) != repr(policy):
            raise ValueError(f"sample_of={sample_of!r} names a request with another policy")
        # What is read from the leader's prefill must be what this sample would have recorded itself.
        lead = leader.params
        if (lead.prompt_logprobs, lead.return_kept) != (params.prompt_logprobs, params.return_kept):
            return None
        return leader

    def _admission_for(self, policy: KVPolicy | None, max_entries: int | None = None) -> Admission | None:
        admission = self.runner.admission_for(policy, min(max_entries or self.max_model_len, self.max_model_len))
        if admission is None:
            return None
        ring_pages = self.config.num_hidden_layers * self.config.num_key_value_heads * admission.window
        ring_pages //= self.cache.page_size
        if ring_pages > self.cache.pool.num_pages:
            raise RequestRejectedError(
                f"the local window ({admission.window} tokens) needs {ring_pages} KV pages but the whole pool has "
                f"{self.cache.pool.num_pages}"
            )
        return admission

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
        for pending in self._pending_samples.values():
            if request in pending:
                pending.remove(request)
        self._release_samples(request)
        self.scheduler.finish(request)
        request.finish_reason = "abort"

    def _release_samples(self, leader: Request) -> None:
        """The leader ends before its first token: its pending samples run alone."""
        for pending in self._pending_samples.pop(leader.request_id, []):
            self.scheduler.add(pending)

    def _fork_samples(self, requests: list[Request], logits: torch.Tensor) -> tuple[list[Request], torch.Tensor]:
        """Requests about to sample their first token start their pending samples from their cache.

        Each sample gets a fork of the leader's row (the compressed prompt, shared) and a copy of its
        policy state, and samples its own first token from the leader's logits with its own generator.
        """
        rows: list[int] = []
        extra: list[Request] = []
        for i, leader in enumerate(requests):
            if leader.output_token_ids or leader.request_id not in self._pending_samples:
                continue
            for follower in self._pending_samples.pop(leader.request_id):
                if self._fork_sample(leader, follower):
                    extra.append(follower)
                    rows.append(i)
                else:
                    self.scheduler.add(follower)
        if not extra:
            return requests, logits
        return requests + extra, torch.cat([logits, logits[torch.tensor(rows, device=logits.device)]])

    def _fork_sample(self, leader: Request, sample: Request) -> bool:
        if len(self.scheduler.active) >= self.scheduler.max_num_seqs:
            return False
        try:
            sample.row = self.cache.fork_request(leader.request_id, sample.request_id)
        except (PoolExhaustedError, RequestCapacityError):
            return False
        sample.status = RequestStatus.RUNNING
        sample.num_processed = leader.num_processed
        sample.policy_state = copy.deepcopy(leader.policy_state)
        sample.kv = copy.deepcopy(leader.kv)
        sample.prompt_logprobs = list(leader.prompt_logprobs)
        self.scheduler.active.append(sample)
        self.runner.update_kv_stats(sample)
        self.samples_forked += 1
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return a snapshot of every request that produced a token or finished."""
        self.last_plan = None
        plan = self.scheduler.schedule()
        # Kept so that a caller whose step raised knows which requests the failed batch held.
        self.last_plan = plan
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
        if self.cache.pages_for_prompt(request.num_tokens + 1) <= self.cache.pool.num_pages:
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
        if self._pending_samples:
            requests, logits = self._fork_samples(requests, logits)
        tokens = sample(logits, requests, self.eos_token_ids)
        record_logprobs(requests, logits, tokens)
        now = time.monotonic()
        for request, token in zip(requests, tokens, strict=True):
            request.output_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            self._check_stop(request, token)
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
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=params.skip_special_tokens)
            for stop in params.stop:
                index = text.find(stop)
                if index >= 0:
                    request.text = text[:index]
                    self._finish(request, "stop", stop)
                    return
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        self._release_samples(request)
        if request.row is not None:
            self.runner.update_kv_stats(request)
            if request.params.return_kept and reason != "error":  # read before `scheduler.finish` frees the row
                request.kv.kept = kept_entries(self.cache, request.request_id)
            if reason != "error":
                for hook in self.finish_hooks:
                    hook(request)
        request.finish_reason = reason
        request.stop_reason = stop_reason
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
            skip = request.params.skip_special_tokens
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=skip)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            text=text,
            finished=request.finished,
            finish_reason=request.finish_reason,
            kv=dataclasses.replace(
                request.kv, kept_per_layer=list(request.kv.kept_per_layer), counters=dict(request.kv.counters)
            ),
            num_preemptions=request.num_preemptions,
            error=request.error,
            logprobs=list(request.output_logprobs) if request.params.logprobs is not None else None,
            prompt_logprobs=list(request.prompt_logprobs) if request.params.prompt_logprobs is not None else None,
            cached_tokens=request.cached_tokens,
        )
