"""`LLMEngine`: requests in, one scheduled step at a time, outputs out.

The step API (`add_request`, `step`, `abort`) is what the HTTP server drives; `LLM` wraps it for
offline batch generation.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.cache import KeepPlan, PagedKVCache, PagePool
from vllm_kvpress_ext.engine.attention_context import DecodeContext, PrefillContext, PrefillSegment
from vllm_kvpress_ext.engine.request import Request, RequestOutput, RequestStatus
from vllm_kvpress_ext.engine.sampler import sample
from vllm_kvpress_ext.engine.sampling_params import SamplingParams
from vllm_kvpress_ext.engine.scheduler import ScheduledChunk, Scheduler
from vllm_kvpress_ext.models import load_model, load_tokenizer
from vllm_kvpress_ext.models.loader import resolve_dtype
from vllm_kvpress_ext.policies import KVPolicy, load_policy
from vllm_kvpress_ext.policies.base import (
    Admission,
    DecodeLayer,
    DecodeStep,
    LayerKeep,
    LayerPrefill,
    RequestPrefill,
)
from vllm_kvpress_ext.policies.capture import PrefillCapture

DEFAULT_KV_MEMORY = 1 << 30
PolicySpec = str | Path | dict[str, Any] | KVPolicy


class RequestRejectedError(ValueError):
    """The request can never run on this engine (too long for the model or for the whole pool)."""


class _LayerwiseCompression:
    """Layer-wise prefill compression of one request, during the forward pass of its last prefill chunk.

    The attention context asks for layer l's slots when the forward pass reaches layer l (earlier
    chunks already hold the prefix in every layer; this chunk's pages are allocated here, one layer
    at a time) and calls `compress(l)` right after layer l's attention: the policy scores the layer
    (`on_layer_prefilled`, with exactly what end-of-prefill compression would see: every prompt
    entry of the layer and its captures), `plan_layer` returns keep masks, and the cache compacts
    those layers at once, returning their pages before layer l + 1 allocates. No later layer
    reads layer l's cache, so hidden states and logits are those of the ordinary path.
    """

    def __init__(self, engine: LLMEngine, request: Request, start: int, end: int) -> None:
        assert request.policy is not None and request.row is not None
        self.engine = engine
        self.request = request
        self.policy: KVPolicy = request.policy
        self.positions = torch.arange(start, end)
        self.state: dict[str, Any] = {}
        request.policy_state = self.state
        self.summary = RequestPrefill(
            request_id=request.request_id,
            num_layers=engine.config.num_hidden_layers,
            num_kv_heads=engine.config.num_key_value_heads,
            num_q_heads=engine.config.num_attention_heads,
            length=end,
        )
        self.results: list[Any] = []
        # Per layer, which prompt entries it still holds ([H, n]; None while it holds them all): how the
        # policy's masks over prompt entries map onto the layer's current (compacted) entries.
        self.held: list[torch.Tensor | None] = [None] * engine.config.num_hidden_layers
        self.seconds = 0.0

    def slots(self, layer: int) -> torch.Tensor:
        """This chunk's slots in `layer`. Cannot exhaust the pool: admission reserved the uncompressed peak."""
        assert self.request.row is not None
        return self.engine.cache.append_layer_slots(layer, self.request.row, self.positions)

    def compress(self, layer: int) -> None:
        start = time.perf_counter()
        prefill = self.engine.layer_prefill(self.request, layer)
        self.results.append(self.policy.on_layer_prefilled(prefill, self.state))
        keep = self.policy.plan_layer(self.summary, layer, self.results, self.state)
        if keep is not None:
            self._apply(keep, layer)
        self.seconds += time.perf_counter() - start

    def _apply(self, keep: LayerKeep, layer: int) -> None:
        """Compact the layers of `keep`; its masks are over prompt entries, the cache wants current entries."""
        if not keep.layers:
            return
        heads, n = self.summary.num_kv_heads, self.summary.length
        masks = keep.masks.cpu()
        if masks.dtype != torch.bool or masks.shape != (len(keep.layers), heads, n):
            raise ValueError(
                f"plan_layer must return bool masks [{len(keep.layers)}, {heads}, {n}], "
                f"got {masks.dtype} {tuple(masks.shape)}"
            )
        if any(not 0 <= m <= layer for m in keep.layers):
            raise ValueError(f"plan_layer after layer {layer} may only cover layers 0..{layer}, got {keep.layers}")
        relative = []
        for m, mask in zip(keep.layers, masks, strict=True):
            held = self.held[m]
            if held is None:
                relative.append(mask)
            else:
                if bool((mask & ~held).any()):
                    raise ValueError(f"plan_layer re-planned layer {m} with entries it had already dropped")
                # Entry e of the prompt now sits at index (number of held entries before it) of its head.
                h_idx, e_idx = held.nonzero(as_tuple=True)
                current = torch.zeros(heads, n, dtype=torch.bool)
                current[h_idx, (held.cumsum(-1) - 1)[h_idx, e_idx]] = mask[h_idx, e_idx]
                relative.append(current)
            self.held[m] = mask
        plan = KeepPlan.from_mask(torch.stack(relative))
        self.engine.cache.apply_keep_plan(self.request.request_id, plan, layers=list(keep.layers))

    def finish(self) -> None:
        """Prefill is over and every layer compressed: drop the captures, account the time."""
        self.request.capture = None
        self.request.kv.compression_seconds += self.seconds


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
    ) -> None:
        self.default_policy = load_policy(kv_policy)
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.model = load_model(self.model_dir, dtype=dtype, device=self.device)
        self.config = self.model.config
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = load_tokenizer(self.model_dir)
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
            max_requests=max_num_seqs,
            dtype=cache_dtype,
            device=self.device,
        )
        self.max_model_len = min(
            max_model_len or self.config.max_position_embeddings, self.config.max_position_embeddings
        )
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.scale = self.config.head_dim**-0.5
        self._ids = itertools.count()
        self.eos_token_ids = set(self.config.eos_token_ids)
        # Called with each request as it finishes, while its entries are still in the cache (benches
        # read what a policy really kept here, e.g. prompt coverage).
        self.finish_hooks: list[Callable[[Request], None]] = []

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        compress_after: int | None = None,
        policy: PolicySpec | None = None,
    ) -> str:
        """Queue a request; `policy` overrides the engine's default (`"full"` turns compression off).

        `compress_after` (default: the whole prompt) is how many prompt tokens are prefilled before
        the policy compresses; the rest of the prompt then runs through decode steps from the
        compressed cache (the strict and question-agnostic evaluation protocols).
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
        if compress_after is not None and not 0 < compress_after <= len(token_ids):
            raise RequestRejectedError(f"compress_after must lie in [1, {len(token_ids)}], got {compress_after}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params, compress_after=compress_after, policy=resolved)
        request.admission = self._admission_for(resolved)
        peak = self.cache.pages_for_prompt(request.prefill_target)
        if peak > self.cache.pool.num_pages:
            raise RequestRejectedError(
                f"prompt needs {peak} KV pages before compression but the whole pool has {self.cache.pool.num_pages}"
            )
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _admission_for(self, policy: KVPolicy | None) -> Admission | None:
        """The policy's write gate bound to this model (checked against it), or None."""
        admission = policy.admission(self.model_dir, self.device) if policy is not None else None
        if admission is None:
            return None
        gates = getattr(admission, "gates", None)
        if gates is not None:
            gates.check_model(
                self.config.num_hidden_layers, self.config.num_key_value_heads, self.config.head_dim, "the write gates"
            )
        if admission.window < 1 or admission.window % self.cache.page_size:
            raise ValueError(
                f"the local window ({admission.window} tokens) must be a positive multiple of the page size "
                f"({self.cache.page_size}): the ring is made of whole pages"
            )
        return admission

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer; pass token ids instead of text")
        return list(self.tokenizer.encode(text))

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and return its pages to the pool."""
        request = self.requests.pop(request_id, None)
        if request is None or request.finished:
            return
        self.scheduler.finish(request)
        request.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------ stepping

    @torch.no_grad()  # not inference_mode: cache tables grown inside a step are mutated outside it later
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return a snapshot of every request that produced a token or finished."""
        plan = self.scheduler.schedule()
        # A preempted request that could not take another token even in an empty pool ends here
        # (with "length": it ran out of room), and is reported like any other finished request.
        touched = [r for r in plan.preempted if self._stop_if_pool_too_small(r)]
        if plan.prefill:
            touched += self._run_prefill(plan.prefill)
        elif plan.decode:
            touched += self._run_decode(plan.decode)
        return [self._snapshot(r) for r in touched]

    def _stop_if_pool_too_small(self, request: Request) -> bool:
        if self.cache.pages_for_prompt(request.num_tokens + 1) <= self.cache.pool.num_pages:
            return False
        self._finish(request, "length")
        return True

    def _run_prefill(self, chunks: list[ScheduledChunk]) -> list[Request]:
        segments: list[PrefillSegment] = []
        token_ids: list[int] = []
        positions: list[int] = []
        layerwise: dict[str, _LayerwiseCompression] = {}
        for chunk in chunks:
            req = chunk.request
            assert req.row is not None
            capture = self._capture_for(req)
            compression = None
            if self._compresses_layerwise(req, chunk):
                compression = layerwise[req.request_id] = _LayerwiseCompression(self, req, chunk.start, chunk.end)
                slots = None  # allocated layer by layer inside the forward pass
            else:
                slots = self.cache.append_slots([req.row], torch.arange(chunk.start, chunk.end).view(1, -1))
            if req.admission is not None and chunk.start == 0:
                req.admitted = [[] for _ in range(self.config.num_hidden_layers)]
            segments.append(
                PrefillSegment(
                    req.row,
                    chunk.start,
                    chunk.end,
                    len(token_ids),
                    slots,
                    capture,
                    req.admission,
                    req.admitted,
                    compression,
                )
            )
            token_ids += req.all_token_ids[chunk.start : chunk.end]
            positions += range(chunk.start, chunk.end)
        ids = torch.tensor(token_ids, device=self.device)
        pos_t = torch.tensor(positions, device=self.device)
        hidden = self.model(ids, pos_t, PrefillContext(self.cache, segments, pos_t, self.scale))
        sampling = [(c, s) for c, s in zip(chunks, segments, strict=True) if c.end == c.request.num_tokens]
        touched: list[Request] = []
        for chunk in chunks:
            chunk.request.num_processed = chunk.end
            if chunk.end == chunk.request.prefill_target:
                self._on_prefill_complete(chunk.request, layerwise.get(chunk.request.request_id))
        if sampling:
            last = torch.tensor([s.offset + s.length - 1 for _, s in sampling], device=self.device)
            logits = self.model.compute_logits(hidden[last])
            touched = self._append_tokens([c.request for c, _ in sampling], logits)
        return touched

    def _run_decode(self, requests: list[Request]) -> list[Request]:
        rows = torch.tensor([r.row for r in requests])
        positions = torch.tensor([[r.num_processed] for r in requests])
        tokens = torch.tensor([r.all_token_ids[r.num_processed] for r in requests], device=self.device)
        slots = self.cache.append_slots(rows, positions)
        want_probs = any(r.policy is not None and r.policy.wants_decode_attention for r in requests)
        context = DecodeContext(self.cache, rows, slots, self.scale, want_probs, self._admission_groups(requests))
        hidden = self.model(tokens, positions.view(-1).to(self.device), context)
        for i, r in enumerate(requests):
            r.num_processed += 1
            if r.policy is not None and r.policy.wants_decode_steps:
                self._on_decode_step(r, i, context)
        needs_token = [i for i, r in enumerate(requests) if r.num_processed == r.num_tokens]
        if not needs_token:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(needs_token, device=self.device)])
        return self._append_tokens([requests[i] for i in needs_token], logits)

    @staticmethod
    def _admission_groups(requests: list[Request]) -> list[tuple[torch.Tensor, Admission]]:
        """Batch indices of the requests sharing each write gate, so each gate runs once per layer."""
        groups: dict[int, tuple[list[int], Admission]] = {}
        for i, r in enumerate(requests):
            if r.admission is not None:
                groups.setdefault(id(r.admission), ([], r.admission))[0].append(i)
        return [(torch.tensor(index), admission) for index, admission in groups.values()]

    def _capture_for(self, request: Request) -> PrefillCapture | None:
        """The request's capture, created on its first chunk; None (no work at all) without a policy."""
        if request.policy is None:
            return None
        if request.capture is None:
            spec = request.policy.capture_spec()
            if spec.empty:
                return None
            request.capture = PrefillCapture(spec, self.config.num_hidden_layers)
        return request.capture

    @staticmethod
    def _compresses_layerwise(request: Request, chunk: ScheduledChunk) -> bool:
        """Layer-wise compression runs on the chunk that completes the prefill, if the policy opts in.

        Earlier chunks write every layer as usual (the policy must see the whole prompt of a layer),
        so the prefill peak falls from the whole prompt in every layer to the earlier chunks' prefix
        in every layer plus, for this chunk, one layer whole and the others compressed. Requests with
        a write gate (WG-KV) keep the end-of-prefill path: their prompt goes through `start_ring`.
        """
        policy = request.policy
        return bool(
            policy is not None
            and policy.compresses_layerwise
            and request.admission is None
            and chunk.end == request.prefill_target
        )

    def layer_prefill(self, request: Request, layer: int, gated: bool = False) -> LayerPrefill:
        """What a policy sees of one layer after prefill: the entries it holds and what the pass captured.

        `gated` (WG-KV admission) passes every head's own positions: heads hold different entries.
        """
        keys, values, positions, _ = self.cache.gather_layer(request.request_id, layer)
        capture = request.capture
        return LayerPrefill(
            layer=layer,
            num_layers=self.config.num_hidden_layers,
            keys=keys,
            values=values,
            positions=positions[0],
            capture=capture.layers[layer] if capture is not None else None,
            model=self.model,
            scale=self.scale,
            head_positions=positions if gated else None,
        )

    def _on_prefill_complete(self, request: Request, layerwise: _LayerwiseCompression | None = None) -> None:
        """Prefill reached `prefill_target`: the policy scores every layer, plans, and the cache compacts.

        With `layerwise`, every layer was already compressed during the forward pass.
        """
        request.status = RequestStatus.RUNNING
        policy = request.policy
        if layerwise is not None:
            layerwise.finish()
        elif policy is not None:
            self._update_kv_stats(request)  # the uncompressed peak
            start = time.perf_counter()
            state: dict[str, Any] = {}
            request.policy_state = state
            num_layers = self.config.num_hidden_layers
            gated = request.admission is not None
            if gated:
                self._start_ring(request)
            results = []
            for layer in range(num_layers):
                results.append(policy.on_layer_prefilled(self.layer_prefill(request, layer, gated), state))
            summary = RequestPrefill(
                request_id=request.request_id,
                num_layers=num_layers,
                num_kv_heads=self.config.num_key_value_heads,
                num_q_heads=self.config.num_attention_heads,
                length=request.num_processed,
            )
            plan = policy.plan(summary, results, state)
            if plan is not None:
                self.cache.apply_keep_plan(request.request_id, plan)
            request.capture = None
            request.kv.compression_seconds += time.perf_counter() - start
        self._update_kv_stats(request)

    def _start_ring(self, request: Request) -> None:
        """Admission at prefill completion: last W tokens into the ring, older ones kept only if admitted."""
        assert request.admission is not None and request.admitted is not None
        admitted = torch.stack([torch.cat(chunks, dim=-1) for chunks in request.admitted]).cpu()  # [L, H, n]
        self.cache.start_ring(request.request_id, request.admission.window, admitted)
        request.admitted = None

    def _on_decode_step(self, request: Request, batch_index: int, context: DecodeContext) -> None:
        """Let the request's policy evict after a decode step (e.g. H2O, bounded StreamingLLM)."""
        assert request.policy is not None and request.row is not None
        start = time.perf_counter()
        positions, lengths = self.cache.entry_positions(request.request_id)
        layers = []
        for layer in range(self.config.num_hidden_layers):
            attention = None
            if context.probs is not None:
                n = positions.shape[-1]
                attention = context.probs[layer][batch_index, :, :, :n].cpu()
            layers.append(DecodeLayer(positions=positions[layer], lengths=lengths[layer], attention=attention))
        step = DecodeStep(request.request_id, request.num_processed - 1, layers)
        eviction = request.policy.on_decode_step(step, request.policy_state)
        if eviction is not None and eviction.entries.numel():
            rows = torch.full_like(eviction.entries, request.row)
            self.cache.evict(rows, eviction.layers, eviction.heads, eviction.entries)
        request.kv.compression_seconds += time.perf_counter() - start

    def _update_kv_stats(self, request: Request) -> None:
        usage = self.cache.usage(request.request_id)
        kv = request.kv
        kv.tokens_kept = usage.tokens
        kv.tokens_full = self.config.num_hidden_layers * self.config.num_key_value_heads * request.num_processed
        kv.kv_bytes = usage.bytes
        # The cache's high-water mark is exact (updated at every allocation, layer-wise prefill included);
        # the max keeps the peak of an earlier life of a preempted request.
        peak = self.cache.peak_pages(request.request_id) * self.cache.pool.bytes_per_page
        kv.kv_bytes_peak = max(kv.kv_bytes_peak, usage.bytes, peak)
        per_head = usage.global_tokens + usage.ring_tokens
        kv.kept_per_head = per_head.tolist()
        kv.kept_per_layer = (per_head.sum(-1) // per_head.shape[-1]).tolist()
        if isinstance(request.policy_state, dict):
            kv.counters = dict(request.policy_state.get("counters", {}))

    # ------------------------------------------------------------------ outputs

    def _append_tokens(self, requests: list[Request], logits: torch.Tensor) -> list[Request]:
        tokens = sample(logits, [r.params for r in requests], [r.generator for r in requests])
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
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
            for stop in params.stop:
                index = text.find(stop)
                if index >= 0:
                    request.text = text[:index]
                    self._finish(request, "stop", stop)
                    return
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        if request.row is not None:
            self._update_kv_stats(request)
            for hook in self.finish_hooks:
                hook(request)
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.scheduler.finish(request)
        if self.tokenizer is not None and not isinstance(stop_reason, str):
            ids = request.output_token_ids
            if stop_reason is not None:
                ids = ids[:-1]
            request.text = self.tokenizer.decode(ids, skip_special_tokens=True)
        self.requests.pop(request.request_id, None)

    def _snapshot(self, request: Request) -> RequestOutput:
        text = request.text
        if not request.finished and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
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
        )
