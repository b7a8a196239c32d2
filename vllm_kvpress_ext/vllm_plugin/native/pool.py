"""`NativePool`: the project's per-(layer, KV head) page pool as the KV cache of vLLM's own model runner.

vLLM's runner keeps its requests, its batch order and its block tables; this pool keeps the keys and
values. vLLM's block manager still plans blocks for every request (its scheduler needs them to
schedule), but no tensor backs them: the attention backend (`native/attention.py`) writes and reads
only the pages here, which are ragged per (layer, KV head) and freed page by page.

A request's life in the pool follows the scheduler's output (`begin_step`):

- a new request, or one resumed after preemption, gets a fresh row (vLLM recomputes a preempted
  request from its first token, so nothing of its earlier row is kept);
- a finished or preempted request's row and pages go back at once;
- each step's tokens get their slots in every (layer, KV head) when the first attention group's
  metadata is built (`plan`), in the batch order of vLLM's runner.

A request whose tokens do not fit, or whose cache disagrees with what vLLM says it computed, fails
alone: it gets no slots, its attention output is zeros, and the step's report names it so the
scheduler finishes it with an error (the other requests of the batch run on).

After each step `report` tells the scheduler (`KVPressScheduler`) the pool's real state: free pages,
pages each request holds, and what each decoding request's next token will allocate, which is how
vLLM's scheduler starts and preempts requests by this pool rather than by its own blocks.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.api.policy_spec import policy_label
from vllm_kvpress_ext.api.usage import kv_figures
from vllm_kvpress_ext.cache import PagedKVCache
from vllm_kvpress_ext.cache.pool import PoolExhaustedError
from vllm_kvpress_ext.engine.admission import PromptAdmission, bind_admission
from vllm_kvpress_ext.engine.compression import StageRelay, compress_prefill, evict_after_decode, layer_prefill
from vllm_kvpress_ext.engine.kept import KeptEntries, kept_entries
from vllm_kvpress_ext.engine.layerwise import LayerwiseCompression
from vllm_kvpress_ext.engine.prefix_store import CachedPrefix, PrefixLease, PrefixStore, prefix_namespace
from vllm_kvpress_ext.engine.reconstruction import ChunkForward, prompts_for_model, score_prompt
from vllm_kvpress_ext.engine.request import KVStats
from vllm_kvpress_ext.models.rope import RotaryEmbedding
from vllm_kvpress_ext.models.write_gate import GateStore
from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.policies.base import Admission, AdmissionPolicy, HeadShard
from vllm_kvpress_ext.policies.capture import PrefillCapture
from vllm_kvpress_ext.vllm_plugin.native.prefix_blocks import PrefixBlocks, keeps_prompt_blocks, readable_prefix
from vllm_kvpress_ext.vllm_plugin.native.support import ModelFacts, QueryProjection, native_refusal
from vllm_kvpress_ext.vllm_plugin.native.tensor_parallel import (
    compressed_layers_per_stage,
    join_replicas,
    relay_stages,
)
from vllm_kvpress_ext.vllm_plugin.report import PoolReport
from vllm_kvpress_ext.vllm_plugin.request_policy import request_policy


@dataclass
class PrefillSpan:
    """Tokens `[begin, end)` of the step, one request's prompt chunk starting at position `first_position`."""

    begin: int
    end: int
    request_id: str
    row: int
    first_position: int
    capture: PrefillCapture | None = None  # what the request's policy records of its prompt
    admission: PromptAdmission | None = None  # a write-gated request's flags so far (WG-KV)
    # The chunk that completes a prompt whose policy compresses layer by layer (XKV, LAVa): its slots come one
    # layer at a time, as the pass reaches each, and each layer is compacted right after its attention.
    layerwise: LayerwiseCompression | None = None


@dataclass
class StepPlan:
    """Where one step's tokens go in the pool, for every layer: built once per step, read by every layer.

    `token_slots[L, T, H]` is the flat slot of token t in (layer, KV head); tokens of a failed request
    are left out of `written` (None: every token is written). Decodes (one token of a request whose cache
    holds its earlier tokens) are batched; prompt chunks are attended one request at a time.
    """

    num_tokens: int
    token_slots: torch.Tensor
    written: torch.Tensor | None
    query_positions: torch.Tensor  # [T] int64
    decode_tokens: torch.Tensor  # [Bd] indices into the step's tokens
    decode_rows: torch.Tensor  # [Bd] their cache rows
    prefills: list[PrefillSpan] = field(default_factory=list)
    failed_tokens: list[tuple[int, int]] = field(default_factory=list)  # [begin, end) spans output as zeros
    # Per layer, the decodes' attention `[Bd, Hkv, G, N]` over each row's entries in storage order, when a
    # decoding request's policy reads it (H2O); filled by the backend as the layers run.
    decode_probs: list[torch.Tensor] | None = None
    # `[L, T, H]`: a second slot of each token in the sliding-window layers (-1: none), in pages of its block
    # kept for vLLM's prefix caching (`_Seat.spill`); None when no token has one.
    spill_slots: torch.Tensor | None = None
    # Write-gated decodes (WG-KV), per bound gate: (their token indices, their rows, the gate); each layer sets the
    # flags of their new ring entries. `rings`: whether any decode's row has a local ring.
    decode_gates: list[tuple[torch.Tensor, torch.Tensor, Admission]] = field(default_factory=list)
    rings: bool = False
    # Per layer, this step's keys before RoPE `[T, Hkv, d]` (read off the QKV projection's output as the layers
    # run), when a write gate reads them this step; None when none does.
    keys_pre_rope: list[torch.Tensor | None] | None = None


@dataclass
class _Seat:
    row: int
    prompt_len: int
    policy: KVPolicy | None = None
    capture: PrefillCapture | None = None
    gate: Admission | None = None  # the policy's write gate bound to the model (WG-KV): a local ring from compression
    admission: PromptAdmission | None = None  # what the gate said of the prompt, until the ring starts
    state: dict[str, Any] = field(default_factory=dict)  # the policy's, from compression on
    written: int = 0  # tokens whose K/V are in the pool (the next token goes to this position)
    compressed: bool = False
    compression_seconds: float = 0.0
    blocks: list[int] = field(default_factory=list)  # vLLM's block ids for the request, in token order
    # Whether its full blocks are kept for vLLM's prefix caching: its page b of every global (layer, KV head)
    # holds tokens [b * page_size, (b + 1) * page_size): a request without a policy, or a compressing one until
    # its policy compresses (`prefix_blocks.keeps_prompt_blocks`; its compaction copies the kept pages it writes).
    aligned: bool = False
    blocks_kept: int = 0  # leading full blocks handed to `prefix_blocks`
    # An aligned row's sliding-window layers are rings, whose pages never hold a block for long: each of its
    # blocks not yet kept also has pages of its own `[Ls, H]` there (block index -> pages, one reference each),
    # written beside the ring, which become the kept block's pages in those layers.
    spill: dict[int, torch.Tensor] = field(default_factory=dict)
    lease: PrefixLease | None = None  # the stored context the row is a fork of (contexts.py), held while it lives


class NativePool:
    """The pool, its rows for vLLM's requests, and the current step's plan."""

    def __init__(
        self,
        cache: PagedKVCache,
        num_q_heads: int,
        scale: float,
        default_policy: KVPolicy | None = None,
        rotary: RotaryEmbedding | None = None,
        prefix_caching: bool = False,
        contexts: PrefixStore | None = None,
        shard: HeadShard | None = None,
    ) -> None:
        # Sliding-window layers are rings of their window in `cache` (`PagedKVCache(layer_windows=...)`): what
        # falls out of a window is overwritten, never held.
        self.cache = cache
        # vLLM's prefix caching: full uncompressed blocks kept under vLLM's block ids (None: off).
        self.prefix_blocks = PrefixBlocks(cache) if prefix_caching else None
        # Named contexts (vllm_plugin/contexts.py): compressed rows stored under their key (None: prefix caching off);
        # the context builds by request id (-> key), from the scheduler; the contexts held for requests about to
        # attach; the keys the last report listed.
        self.contexts = contexts
        self.context_builds: dict[str, str] = {}
        self.held_contexts: dict[str, PrefixLease] = {}
        self.built_for: frozenset[str] = frozenset()
        self._reported_contexts: set[str] = set()
        # A prefix hit rebuilds each ring from the last window's blocks, a page per ring page: a window must be
        # whole pages for that (Gemma 2 and 3's are), else a model with rings keeps no blocks.
        windows = cache.layer_windows[cache.sliding_layers]
        self.rings_keep_blocks = bool((windows % cache.page_size == 0).all())
        self.rotary = rotary  # the model's RoPE where the project knows it (`native_rope`)
        # KVzip's reconstruction pass: one chunk's forward of vLLM's model (set by the runner), the directory of
        # the tokenizer its prompt is written with, and whether a pass is running (no step is then).
        self.reconstruction_forward: ChunkForward | None = None
        self.tokenizer_dir: str | None = None
        self.reconstructing = False
        # Per layer, the query projection (`support.layer_projections`), where the runner found and hooked them.
        self.query_projections: list[QueryProjection] | None = None
        # Where write gates are found (beside the model, or shipped for a catalog GGUF file), the requests' length
        # limit (a ring never spans more), and the gate files loaded so far (set by the runner).
        self.model_path: Path | None = None
        self.max_model_len: int | None = None
        self.gate_store = GateStore()
        # Each layer's attention logit soft cap (Gemma 2), or None: set by the runner.
        self.soft_caps: list[float | None] = []
        self.num_q_heads = num_q_heads
        # Tensor parallelism: this worker's KV heads among the model's (None: all of them are here). Policies gather
        # what crosses heads (`policies/base.HeadShard`); layer-wise compression is off, its collectives would run
        # inside the forward pass, where one worker's failed request would leave the others waiting.
        self.shard = shard
        # Pipeline parallelism: the stages the model's layers are split over (this pool holds one stage's layers; set
        # by the runner). A policy that decides across layers runs stage after stage (`_stage_relay`); layer-wise
        # compression is off, as under tensor parallelism.
        self.pipeline_stages = 1
        self.stage: tuple[int, int] | None = None  # this stage's first layer among the model's, and their number
        self._compressed_layers: int | None = None  # over every stage, once a policy deciding across layers ran
        self.scale = scale
        self.default_policy = default_policy
        self.seats: dict[str, _Seat] = {}
        # Each live request's prompt length and sampling parameters (vLLM sends them once, when it starts), and its
        # prompt's token ids where its policy reads them (KVzip's reconstruction pass repeats them).
        self.prompts: dict[str, tuple[int, Any]] = {}
        self.prompt_tokens: dict[str, list[int]] = {}
        self.preemptions: dict[str, int] = {}  # times each live request was preempted (its figures say so)
        self.failed: dict[str, str] = {}
        # Set to a dict to keep, per request, what it held right after its policy compressed (tests, analysis).
        self.kept_at_compression: dict[str, KeptEntries] | None = None
        self._plan: StepPlan | None = None
        self.decode_request_ids: list[str] = []  # the step's decodes, in the order of `StepPlan.decode_rows`

    # ------------------------------------------------------------------ lifecycle

    def begin_step(self, scheduler_output: Any) -> None:
        """Free what the scheduler finished or preempted, seat what it starts; forget the last plan."""
        self._plan = None
        self.failed = {}
        self.context_builds.update(getattr(scheduler_output, "kvpress_contexts", None) or {})
        promised: dict[str, tuple[str, int]] = getattr(scheduler_output, "kvpress_attach", None) or {}
        # Promised requests that waited for their context's build: they attach to it, but found nothing cached.
        self.built_for = getattr(scheduler_output, "kvpress_built_for", None) or frozenset()
        for request_id in scheduler_output.finished_req_ids:
            self.release(request_id)
            self.prompts.pop(request_id, None)
            self.prompt_tokens.pop(request_id, None)
            self.preemptions.pop(request_id, None)
            self.context_builds.pop(request_id, None)
        for request_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self.release(request_id)
            self.preemptions[request_id] = self.preemptions.get(request_id, 0) + 1
        for new in scheduler_output.scheduled_new_reqs:
            self.release(new.req_id)  # an aborted request resubmitted under the same id starts over
            prompt = new.prompt_token_ids
            self.prompts[new.req_id] = (len(prompt) if prompt is not None else 0, new.sampling_params)
            if prompt is not None:
                self.prompt_tokens[new.req_id] = list(prompt)
            blocks = list(new.block_ids[0]) if new.block_ids else []
            self._seat(new.req_id, new.num_computed_tokens, blocks, promised.get(new.req_id))
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[index]
            blocks = list(new_blocks[0]) if new_blocks else []
            if request_id in cached.resumed_req_ids:
                self.release(request_id)
                self._seat(request_id, cached.num_computed_tokens[index], blocks, promised.get(request_id))
            elif request_id in self.seats:
                self._forget_blocks(blocks)
                self.seats[request_id].blocks.extend(blocks)
        self._hold_contexts(getattr(scheduler_output, "kvpress_held", None) or ())

    def _hold_contexts(self, keys: Iterable[str]) -> None:
        """Hold the stored contexts waiting requests will attach to (and only those): none is evicted first."""
        wanted = set(keys)
        for key in [k for k in self.held_contexts if k not in wanted]:
            self.held_contexts.pop(key).release()
        for key in wanted - set(self.held_contexts):
            lease = self.contexts.lease(key) if self.contexts is not None else None
            if lease is not None:
                self.held_contexts[key] = lease

    def _forget_blocks(self, block_ids: list[int]) -> None:
        """Block ids vLLM gave to new tokens: whatever they held before is no longer in its prefix cache."""
        if self.prefix_blocks is not None:
            self.prefix_blocks.forget(block_ids)

    def _seat(self, request_id: str, computed: int, blocks: list[int], context: tuple[str, int] | None = None) -> None:
        """A row for a starting request: fresh, on vLLM's prefix-cache hits (`computed` tokens, in kept blocks), or
        on a fork of the stored `context` (key, tokens) the scheduler promised it."""
        hits = computed // self.cache.page_size
        self._forget_blocks(blocks[hits:])
        prompt_len, params = self.prompts.get(request_id, (0, None))
        try:
            policy = request_policy(getattr(params, "extra_args", None), self.default_policy)
        except ValueError as exc:  # the API process validated it; a request from elsewhere may not be
            self.failed[request_id] = str(exc)
            return
        facts = ModelFacts(
            rope=self.rotary is not None,
            projections=self.query_projections is not None,
            tensor_parallel=1 if self.shard is None else self.shard.workers,
        )
        refusal = native_refusal(policy, facts)
        if refusal is not None:
            self.failed[request_id] = refusal
            return
        if context is not None:
            self._seat_on_context(request_id, computed, blocks, policy, context)
            return
        kept = self.prefix_blocks
        if computed and (
            kept is None
            or computed % self.cache.page_size
            or computed > readable_prefix(policy, prompt_len)
            or not kept.holds(blocks[:hits])
        ):
            # The scheduler caps vLLM's prefix-cache hits at the blocks kept here, and a compressing request's
            # at what its policy lets it read, so this is a bug, not a miss: the request fails rather than run
            # on what is not there.
            self.failed[request_id] = f"vLLM reports {computed} tokens computed that the pool does not hold"
            return
        try:
            if computed:
                assert kept is not None
                row = self.cache.add_request_on_pages(request_id, kept.pages_of(blocks[:hits]))
            else:
                row = self.cache.add_request(request_id)
        except RuntimeError as exc:  # every row taken: more requests than max_num_seqs
            self.failed[request_id] = str(exc)
            return
        capture = None
        if policy is not None and not policy.capture_spec().empty:
            capture = PrefillCapture(policy.capture_spec(), self.cache.num_layers, self.rotary)
        try:
            gate = self.bind_gate(policy, prompt_len, params)
        except Exception as exc:  # no gates for this model, gates of another model, a ring that cannot fit
            self.cache.free_request(request_id)
            self.failed[request_id] = str(exc)
            return
        self.seats[request_id] = _Seat(
            row=row,
            prompt_len=prompt_len,
            policy=policy,
            capture=capture,
            gate=gate,
            admission=PromptAdmission(gate, policy, self.cache.num_layers)
            if gate and isinstance(policy, AdmissionPolicy)
            else None,
            written=computed,
            blocks=blocks,
            aligned=keeps_prompt_blocks(policy) and self.prefix_blocks is not None and self.rings_keep_blocks,
            blocks_kept=hits,
        )

    def _seat_on_context(
        self, request_id: str, computed: int, blocks: list[int], policy: KVPolicy | None, context: tuple[str, int]
    ) -> None:
        """Seat a request on a fork of its stored context: compressed, `computed` tokens written, the policy state
        the context left; vLLM then runs the rest of its prompt as a prefill chunk over it."""
        key, length = context
        lease = self.contexts.lease(key) if self.contexts is not None else None
        tokens = tuple(self.prompt_tokens.get(request_id, ())[:length])
        if lease is None or computed != length or lease.entry.length != length or lease.entry.tokens != tokens:
            if lease is not None:
                lease.release()
            # The scheduler promises only what the store lists and the worker holds for it: a bug, not a miss.
            self.failed[request_id] = f"vLLM counts a context of {computed} tokens computed that the pool does not hold"
            return
        assert self.contexts is not None
        self._forget_blocks(blocks)  # all new: whatever they held before is out of vLLM's prefix cache
        try:
            row = self.contexts.fork_entry(lease, request_id, hit=request_id not in self.built_for)
        except (RuntimeError, PoolExhaustedError) as exc:  # no row free (more requests than max_num_seqs)
            lease.release()
            self.failed[request_id] = str(exc)
            return
        prompt_len = self.prompts.get(request_id, (0, None))[0]
        self.seats[request_id] = _Seat(
            row=row,
            prompt_len=prompt_len,
            policy=policy,
            state=copy.deepcopy(lease.entry.policy_state),
            written=length,
            compressed=True,
            blocks=blocks,
            lease=lease,
        )

    def _keep_context(self, request_id: str, seat: _Seat) -> None:
        """A context build compressed its prompt: the store keeps a fork of the row under the scheduler's key."""
        store, key = self.contexts, self.context_builds.get(request_id)
        if store is None or key is None or key in store.entries:
            return
        if len(store.entries) >= store.capacity and all(entry.users for entry in store.entries.values()):
            self._drop_a_held_context()
        tokens = tuple(self.prompt_tokens.get(request_id, ())[: seat.written])
        namespace = prefix_namespace(store.model_dir, seat.policy)
        entry = CachedPrefix(
            key, "", len(tokens), None, KVStats(), tokens=tokens, namespace=namespace, boundary=len(tokens)
        )
        store.keep_row(request_id, entry, copy.deepcopy(seat.state), KVStats())

    def _drop_a_held_context(self) -> None:
        """Free the store's least recently used context that only waiting requests want (none is seated on it), for
        a new one: those requests find it gone and have it built again, rather than the new one being lost."""
        assert self.contexts is not None
        for key, entry in self.contexts.entries.items():
            lease = self.held_contexts.get(key)
            if lease is not None and entry.users == 1:
                del self.held_contexts[key]
                lease.release()
                self.contexts.evict_one()
                return

    def bind_gate(self, policy: KVPolicy | None, prompt_len: int, params: Any) -> Admission | None:
        """The request's write gate bound to the model and the pool (`engine/admission.py`), or None: its ring
        spans at most what the request can write, as in the embedded engine."""
        if not isinstance(policy, AdmissionPolicy):
            return None
        if self.model_path is None:
            raise ValueError("write gates need the model's path, which the runner has not given this pool")
        limit = self.max_model_len or prompt_len + 1
        max_tokens = getattr(params, "max_tokens", None)
        most = min(prompt_len + (max_tokens if max_tokens is not None else limit) - 1, limit)
        return bind_admission(
            policy, self.cache, self.model_path, self.cache.device, self.gate_store, most, self.shard, self.stage
        )

    def release(self, request_id: str) -> None:
        seat = self.seats.pop(request_id, None)
        if seat is not None:
            self.cache.free_request(request_id)
            if seat.lease is not None:
                seat.lease.release()
            if seat.spill:
                self.cache.pool.free(torch.cat([pages.reshape(-1) for pages in seat.spill.values()]))

    def _fail(self, request_id: str, message: str) -> None:
        self.failed[request_id] = message
        self.release(request_id)

    def fail_as_elsewhere(self, failed: dict[str, str]) -> None:
        """Fail here the requests another tensor-parallel worker failed (`tensor_parallel.agree_on_failures`)."""
        for request_id, message in failed.items():
            if request_id not in self.failed:
                self._fail(request_id, message)

    # ------------------------------------------------------------------ the step

    @property
    def current(self) -> StepPlan:
        if self._plan is None:
            raise RuntimeError("attention ran before the pool planned the step")
        return self._plan

    def plan(self, req_ids: list[str], query_start_loc: list[int], seq_lens: list[int]) -> StepPlan:
        """Allocate this step's slots (once: every attention group's builder asks, the first one plans)."""
        if self._plan is not None:
            return self._plan
        cache = self.cache
        num_tokens = query_start_loc[len(req_ids)]
        token_slots = torch.full(
            (cache.num_layers, num_tokens, cache.num_kv_heads), -1, dtype=torch.int64, device=cache.device
        )
        query_positions = torch.empty(num_tokens, dtype=torch.int64)
        written = torch.ones(num_tokens, dtype=torch.bool)
        # Where aligned rows' tokens also go in the sliding-window layers (`_Seat.spill`), -1 elsewhere.
        spills = cache.has_sliding_layers and any(seat.aligned for seat in self.seats.values())
        spill_slots = torch.full_like(token_slots, -1) if spills else None
        decodes: list[tuple[str, int, int]] = []  # (request, token index, position)
        prefills: list[PrefillSpan] = []
        failed_tokens: list[tuple[int, int]] = []
        for index, request_id in enumerate(req_ids):
            begin, end = query_start_loc[index], query_start_loc[index + 1]
            first = seq_lens[index] - (end - begin)
            query_positions[begin:end] = torch.arange(first, seq_lens[index])
            seat = self.seats.get(request_id)
            if seat is not None and seat.written != first:
                self._fail(request_id, f"vLLM runs position {first}, the pool holds {seat.written} tokens")
                seat = None
            if seat is None:
                self.failed.setdefault(request_id, "the request has no cache row")
                written[begin:end] = False
                failed_tokens.append((begin, end))
                continue
            if end - begin == 1 and first > 0 and first >= seat.prompt_len:
                # A decode: one token past the prompt. A prompt's last token alone in a chunk is a prefill: its
                # query is in the policy's observation window, and the policy compresses after it.
                decodes.append((request_id, begin, first))
                continue
            layerwise = self._layerwise(request_id, seat, first, seq_lens[index])
            if layerwise is not None:  # written layer by layer (`do_kv_cache_update`), not here
                written[begin:end] = False
            else:
                try:
                    slots = self._append_slots([seat.row], query_positions[begin:end].view(1, -1))  # [L, 1, H, n]
                except PoolExhaustedError as exc:
                    self._fail(request_id, str(exc))
                    written[begin:end] = False
                    failed_tokens.append((begin, end))
                    continue
                token_slots[:, begin:end] = slots[:, 0].transpose(1, 2)
            if seat.aligned and spill_slots is not None:
                try:
                    spill_slots[cache.sliding_layers, begin:end] = self._spill_slots(seat, query_positions[begin:end])
                except PoolExhaustedError as exc:
                    self._fail(request_id, str(exc))
                    written[begin:end] = False
                    failed_tokens.append((begin, end))
                    continue
            seat.written = seq_lens[index]
            capture = seat.capture if not seat.compressed else None
            prefills.append(PrefillSpan(begin, end, request_id, seat.row, first, capture, seat.admission, layerwise))
        self._plan_decodes(decodes, token_slots, written, failed_tokens)
        for request_id, token, position in decodes:
            seat = self.seats.get(request_id)
            if seat is None or not seat.aligned or spill_slots is None:
                continue
            try:
                spill_slots[cache.sliding_layers, token : token + 1] = self._spill_slots(seat, torch.tensor([position]))
            except PoolExhaustedError as exc:
                self._fail(request_id, str(exc))
                written[token] = False
                failed_tokens.append((token, token + 1))
        # The decodes that got their slots, in batch order (`plan` walks the batch in order).
        self.decode_request_ids = [request_id for request_id, _, _ in decodes if request_id in self.seats]
        decode_tokens = torch.tensor([token for r, token, _ in decodes if r in self.seats], dtype=torch.int64)
        decode_rows = torch.tensor([self.seats[r].row for r in self.decode_request_ids], dtype=torch.int64)
        wants_probs = any(self._wants_attention(request_id) for request_id in self.decode_request_ids)
        decode_gates = self._decode_gates(decode_tokens)
        gated = bool(decode_gates) or any(span.admission is not None for span in prefills)
        self._plan = StepPlan(
            num_tokens=num_tokens,
            token_slots=token_slots,
            written=None if bool(written.all()) else written.to(cache.device),
            query_positions=query_positions,
            decode_tokens=decode_tokens,
            decode_rows=decode_rows,
            prefills=prefills,
            failed_tokens=failed_tokens,
            decode_probs=[] if wants_probs else None,
            spill_slots=spill_slots,
            decode_gates=decode_gates,
            rings=bool((cache.rings.window[decode_rows] > 0).any()) if decode_rows.numel() else False,
            keys_pre_rope=[None] * cache.num_layers if gated else None,
        )
        return self._plan

    def _layerwise(self, request_id: str, seat: _Seat, first: int, end: int) -> LayerwiseCompression | None:
        """Layer-wise compression (`engine/layerwise.py`, as the embedded engine runs it) of the chunk `[first, end)`
        if it completes a prompt whose policy compresses layer by layer: the prefill then holds the policy's
        declared peak, which the scheduler reserved for a prompt in one chunk, rather than the whole prompt in
        every layer. Not with a write gate, nor on a model with sliding-window layers (as in the embedded engine),
        nor over tensor-parallel workers or pipeline stages."""
        policy = seat.policy
        if (
            policy is None
            or not policy.compresses_layerwise
            or seat.compressed
            or end != seat.prompt_len
            or seat.gate is not None
            or self.cache.has_sliding_layers
            or self.shard is not None
            or self.pipeline_stages > 1
        ):
            return None
        capture, projections = seat.capture, self.query_projections

        def shown(layer: int) -> Any:
            project = projections[layer] if projections is not None else None
            return layer_prefill(self.cache, request_id, layer, capture, None, self.scale, False, self.rotary, project)

        return LayerwiseCompression(self.cache, policy, request_id, seat.row, first, end, self.num_q_heads, shown)

    def _decode_gates(self, decode_tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, Admission]]:
        """The step's write-gated decodes (`decode_request_ids`, tokens at `decode_tokens`), grouped by gate so
        that each gate runs once per layer."""
        groups: dict[int, tuple[list[int], list[int], Admission]] = {}
        for index, request_id in enumerate(self.decode_request_ids):
            seat = self.seats[request_id]
            if seat.gate is not None and seat.compressed:
                group = groups.setdefault(id(seat.gate), ([], [], seat.gate))
                group[0].append(int(decode_tokens[index]))
                group[1].append(seat.row)
        return [(torch.tensor(tokens), torch.tensor(rows), gate) for tokens, rows, gate in groups.values()]

    def _spill_slots(self, seat: _Seat, positions: torch.Tensor) -> torch.Tensor:
        """Slots `[Ls, n, H]` of an aligned row's tokens at `positions` in its blocks' own pages in the
        sliding-window layers (`_Seat.spill`), each block's pages allocated as it starts."""
        cache, page_size = self.cache, self.cache.page_size
        sliding = cache.sliding_layers
        blocks = torch.div(positions, page_size, rounding_mode="floor")
        new = [b for b in torch.unique(blocks).tolist() if b not in seat.spill]
        if new:
            count = len(new) * sliding.numel() * cache.num_kv_heads
            try:
                pages = cache.pool.allocate(count)
            except PoolExhaustedError:
                if not self._make_room(count):
                    raise
                pages = cache.pool.allocate(count)
            for block, block_pages in zip(new, pages.view(len(new), sliding.numel(), cache.num_kv_heads), strict=True):
                seat.spill[block] = block_pages
        by_block = torch.stack([seat.spill[b] for b in blocks.tolist()], dim=1)  # [Ls, n, H]
        slots = by_block * page_size + (positions % page_size).view(1, -1, 1)
        cache.pool.positions.view(-1)[slots.reshape(-1).to(cache.device)] = (
            positions.view(1, -1, 1).expand_as(slots).reshape(-1).to(device=cache.device, dtype=torch.int32)
        )
        return slots

    def _append_slots(self, rows: list[int], positions: torch.Tensor) -> torch.Tensor:
        """`PagedKVCache.append_slots`, dropping what is kept for reuse (`_make_room`) when the free pages are too
        few: cached prefixes go before any request fails for pages."""
        try:
            return self.cache.append_slots(rows, positions)
        except PoolExhaustedError as exc:
            if not self._make_room(exc.requested):
                raise
            return self.cache.append_slots(rows, positions)

    def _make_room(self, pages: int) -> bool:
        """Drop kept prefix blocks, then stored contexts, least recently used first (none a request reads), until
        `pages` pages are free; whether they are."""
        if self.prefix_blocks is not None and self.prefix_blocks.free_up(pages):
            return True
        if self.contexts is not None:
            self.contexts.evict_until(pages)
        return self.cache.pool.num_free >= pages

    def _drop_one_kept(self) -> bool:
        """Drop the least recently used kept block, else stored context; False when there is none to drop."""
        if self.prefix_blocks is not None and self.prefix_blocks.drop_oldest():
            return True
        return self.contexts is not None and self.contexts.evict_one() is not None

    def record_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        """A layer's attention input this step (`[T, D]`, batch order): into the captures that keep its statistics."""
        plan = self._plan
        if plan is None or self.reconstructing:
            return
        for span in plan.prefills:
            if span.capture is not None and span.capture.spec.hidden_stats:
                span.capture.record_hidden(layer, hidden[span.begin : span.end])

    def record_keys(self, layer: int, qkv: torch.Tensor, split: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A layer's QKV projection output this step (`[T, ...]`, batch order): its keys before RoPE, kept for the
        step's write gates (`StepPlan.keys_pre_rope`) when any reads them."""
        plan = self._plan
        if plan is None or plan.keys_pre_rope is None or self.reconstructing:
            return
        plan.keys_pre_rope[layer] = split(qkv[: plan.num_tokens])

    def _wants_attention(self, request_id: str) -> bool:
        policy = self.seats[request_id].policy
        return policy is not None and policy.wants_decode_steps and policy.wants_decode_attention

    def _plan_decodes(
        self,
        decodes: list[tuple[str, int, int]],
        token_slots: torch.Tensor,
        written: torch.Tensor,
        failed_tokens: list[tuple[int, int]],
    ) -> None:
        """One allocation for the batch's decodes; if it does not fit, halves of it in turn, so only the
        requests that do not fit fail."""
        cache = self.cache
        groups = [decodes]
        while groups:
            group = groups.pop()
            if not group:
                continue
            rows = [self.seats[request_id].row for request_id, _, _ in group]
            positions = torch.tensor([[position] for _, _, position in group], dtype=torch.int64)
            try:
                slots = self._append_slots(rows, positions)  # [L, B, H, 1]
            except PoolExhaustedError as exc:
                if len(group) > 1:
                    groups.extend([group[: len(group) // 2], group[len(group) // 2 :]])
                    continue
                request_id, token, _ = group[0]
                self._fail(request_id, str(exc))
                written[token] = False
                failed_tokens.append((token, token + 1))
                continue
            tokens = torch.tensor([token for _, token, _ in group], dtype=torch.int64)
            token_slots[:, tokens.to(cache.device)] = slots[..., 0]
            for request_id, _, position in group:
                self.seats[request_id].written = position + 1

    # ------------------------------------------------------------------ the policies, after the forward pass

    def apply_policies(self) -> None:
        """Compress each request whose prompt this step completed; let decode-time policies evict after the
        step's token. A policy that raises fails its request alone."""
        plan = self._plan
        if plan is None:
            return
        if self.prefix_blocks is not None:  # before any policy drops an entry of this step's blocks
            for candidate in self.seats.values():
                if candidate.aligned:
                    self._keep_full_blocks(candidate)
        layerwise = {span.request_id: span.layerwise for span in plan.prefills if span.layerwise is not None}
        for request_id in [r for r, seat in self.seats.items() if self._completes_prefill(seat)]:
            compression = layerwise.get(request_id)
            if compression is not None:
                self._run_policy(request_id, lambda rid, c=compression: self._finish_layerwise(rid, c))
            else:
                self._run_policy(request_id, self._compress)
        for span in plan.prefills:  # a write-gated chunk that did not end its prompt: its unadmitted entries go
            seat = self.seats.get(span.request_id)
            if seat is not None and seat.admission is not None and not seat.compressed:
                admission = seat.admission
                self._run_policy(span.request_id, lambda rid, a=admission: a.drop_unadmitted(self.cache, rid))
        decode_batch = {request_id: index for index, request_id in enumerate(self.decode_request_ids)}
        if plan.decode_probs and self._replicas > 1:  # `[B, Hkv, G, N]` per layer: the whole query group's G
            plan.decode_probs = self._join_replicas([(probs, 2) for probs in plan.decode_probs])
        for request_id, index in decode_batch.items():
            seat = self.seats.get(request_id)
            if seat is not None and seat.compressed and seat.policy is not None and seat.policy.wants_decode_steps:
                self._run_policy(request_id, lambda rid, i=index: self._evict(rid, i, plan))

    @property
    def _replicas(self) -> int:
        """Workers holding each of this worker's KV heads: more than 1 where vLLM replicates them (more
        tensor-parallel workers than KV heads), each replica computing part of the head's query group."""
        return 1 if self.shard is None else self.shard.replicas

    def _join_replicas(self, tensors: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        return join_replicas(tensors, self._replicas)

    def _group_projection(self, project: QueryProjection) -> QueryProjection:
        """A layer's query projection `[S, D] -> [S, Hq, d]` giving every query head of this worker's KV head."""

        def projected(hidden: torch.Tensor) -> torch.Tensor:
            return self._join_replicas([(project(hidden), 1)])[0]

        return projected

    def _keep_full_blocks(self, seat: _Seat) -> None:
        """Hand an aligned row's newly full blocks to `prefix_blocks`, under their vLLM block ids: the row's own
        pages in the global layers (shared), its blocks' spill pages in the sliding-window layers (their one
        reference passes to the kept block)."""
        assert self.prefix_blocks is not None
        cache = self.cache
        full = min(seat.written // cache.page_size, len(seat.blocks))
        tables = cache.block_tables[:, seat.row]  # [L, H, pages]
        for index in range(seat.blocks_kept, full):
            pages = tables[:, :, index].to(torch.int64)
            spill = seat.spill.pop(index, None)
            if spill is not None:
                pages[cache.sliding_layers] = spill
            self.prefix_blocks.keep(seat.blocks[index], pages)
            if spill is not None:
                cache.pool.free(spill.reshape(-1))
        seat.blocks_kept = max(seat.blocks_kept, full)

    @staticmethod
    def _completes_prefill(seat: _Seat) -> bool:
        return seat.policy is not None and not seat.compressed and 0 < seat.prompt_len <= seat.written

    def _run_policy(self, request_id: str, step: Any) -> None:
        seat = self.seats[request_id]
        start = time.perf_counter()
        try:
            step(request_id)
        except Exception as exc:  # a policy's failure is its request's, never the batch's
            self._fail(request_id, f"{policy_label(seat.policy)} failed: {exc}")
            return
        seat.compression_seconds += time.perf_counter() - start

    def _compress(self, request_id: str) -> None:
        seat = self.seats[request_id]
        assert seat.policy is not None
        if seat.capture is not None and seat.capture.spec.reconstruction is not None:
            self._score_by_reconstruction(request_id, seat)
        seat.state = {}
        shard = self.shard
        projections = self.query_projections
        if self._replicas > 1:  # every replica of a KV head sees its whole query group, as one worker would
            if seat.capture is not None:
                seat.capture.join_query_heads(self._join_replicas)
            if projections is not None:
                projections = [self._group_projection(project) for project in projections]
        if seat.admission is not None:  # the last window into the local ring, older entries only if admitted
            seat.admission.start_ring(self.cache, request_id)
            seat.admission = None
        compress_prefill(
            self.cache,
            request_id,
            seat.policy,
            seat.capture,
            num_q_heads=self.num_q_heads if shard is None else self.num_q_heads * shard.workers,
            length=seat.written,
            model=None,
            scale=self.scale,
            state=seat.state,
            rotary=self.rotary,
            query_projections=projections,
            gated=seat.gate is not None,
            # Entries moved into pages shared with kept blocks copy them first; kept blocks go where that lacks room.
            make_room=self._drop_one_kept,
            shard=shard,
            stages=self._stage_relay() if self.pipeline_stages > 1 and seat.policy.decides_across_layers else None,
        )
        self._compressed(request_id, seat)

    def _stage_relay(self) -> StageRelay:
        """The pipeline stages' relay for a policy that decides across layers (`compression.plan_stage_by_stage`);
        the stages' layer counts are exchanged at the first such request, which every stage compresses."""
        if self._compressed_layers is None:
            self._compressed_layers = sum(compressed_layers_per_stage(len(self.cache.global_layers)))
        return StageRelay(self._compressed_layers, relay_stages)

    def _finish_layerwise(self, request_id: str, compression: LayerwiseCompression) -> None:
        """The prompt's last chunk compressed every layer during the pass; a failure there fails the request."""
        if compression.error is not None:
            raise compression.error
        seat = self.seats[request_id]
        seat.state = compression.state
        seat.compression_seconds += compression.seconds
        self._compressed(request_id, seat)

    def _compressed(self, request_id: str, seat: _Seat) -> None:
        seat.compressed, seat.capture, seat.aligned = True, None, False
        if request_id in self.context_builds:
            self._keep_context(request_id, seat)
        if seat.spill:  # its blocks' own pages in the sliding layers: no further block of it is kept
            self.cache.pool.free(torch.cat([pages.reshape(-1) for pages in seat.spill.values()]))
            seat.spill = {}
        if self.kept_at_compression is not None:
            self.kept_at_compression[request_id] = kept_entries(self.cache, request_id)

    def _score_by_reconstruction(self, request_id: str, seat: _Seat) -> None:
        """KVzip's pass over the request's whole prompt (`engine/reconstruction.py`), vLLM's model running each
        chunk through the backend, which attends over the row and scores it without writing."""
        capture = seat.capture
        assert capture is not None and capture.spec.reconstruction is not None
        if self.reconstruction_forward is None or self.tokenizer_dir is None:
            raise ValueError("the reconstruction pass needs the model runner, which has not bound this pool")
        tokens = self.prompt_tokens[request_id][: seat.written]
        prompts = prompts_for_model(self.tokenizer_dir)
        self.reconstructing = True
        try:
            scores = score_prompt(
                self.cache,
                seat.row,
                tokens,
                capture.spec.reconstruction,
                prompts,
                self.scale,
                self.reconstruction_forward,
                self.soft_caps,
            )
        finally:
            self.reconstructing = False
        if self._replicas > 1:  # each entry's score is its largest over the KV head's query group
            scores = [joined.amax(0) for joined in self._join_replicas([(score[None], 0) for score in scores])]
        for layer, layer_scores in zip(capture.layers, scores, strict=True):
            layer.reconstruction_scores = layer_scores

    def _evict(self, request_id: str, batch_index: int, plan: StepPlan) -> None:
        seat = self.seats[request_id]
        assert seat.policy is not None
        probs = plan.decode_probs

        def attention(layer: int, entries: int) -> torch.Tensor | None:
            return None if probs is None else probs[layer][batch_index, :, :, :entries].cpu()

        evict_after_decode(self.cache, request_id, seat.policy, seat.state, seat.written - 1, attention)

    # ------------------------------------------------------------------ what the scheduler learns

    def _report_contexts(self, report: PoolReport, store: PrefixStore) -> None:
        """The stored contexts as the scheduler's mirror needs them (what was added and what is left), the pages
        dropping the unused ones would free, and the store's figures."""
        view = store.view(self._reported_contexts)
        report.add_store(view)
        self._reported_contexts = set(view.keys)

    def report(self) -> PoolReport:
        cache = self.cache
        report = PoolReport(
            pages_total=cache.pool.num_pages,
            pages_free=cache.pool.num_free,
            page_size=cache.page_size,
            pages_per_token_block=cache.num_layers * cache.num_kv_heads,
            page_bytes=cache.pool.bytes_per_page,
            failed=dict(self.failed),
            num_layers=cache.num_layers,
            num_kv_heads=cache.num_kv_heads,
            compresses_layerwise=not cache.has_sliding_layers and self.shard is None and self.pipeline_stages == 1,
        )
        if self.prefix_blocks is not None:
            report.prefix_evictable = self.prefix_blocks.evictable_pages()
            report.prefix_blocks = self.prefix_blocks.changes()
        if self.contexts is not None:
            self._report_contexts(report, self.contexts)
        decoding = [(request_id, seat) for request_id, seat in self.seats.items() if seat.written >= seat.prompt_len]
        if decoding:
            rows = torch.tensor([seat.row for _, seat in decoding], dtype=torch.int64)
            # Per request: the pages its next token allocates (the pages rows share with kept prefix blocks are
            # full ones, so no copy-on-write adds to it).
            next_pages = cache.pages_to_append(rows, 1)
            for (request_id, seat), pages in zip(decoding, next_pages.tolist(), strict=True):
                # An aligned row starting a block also takes that block's spill pages.
                starts_block = seat.aligned and cache.has_sliding_layers and seat.written % cache.page_size == 0
                spill = cache.sliding_layers.numel() * cache.num_kv_heads if starts_block else 0
                report.decode_pages[request_id] = int(pages) + spill
        for (request_id, seat), usage in zip(self.seats.items(), cache.usages(list(self.seats)), strict=True):
            report.pages_held[request_id] = usage.pages + sum(pages.numel() for pages in seat.spill.values())
            if seat.written < seat.prompt_len:
                continue
            kv = KVStats(
                tokens_kept=usage.tokens,
                tokens_full=cache.num_layers * cache.num_kv_heads * seat.written,
                kv_bytes=usage.bytes,
                # The row's high-water mark (exact: counted at every allocation since the row was seated).
                kv_bytes_peak=cache.peak_pages(request_id) * cache.pool.bytes_per_page,
                compression_seconds=seat.compression_seconds,
            )
            report.kv[request_id] = kv_figures(policy_label(seat.policy), kv, self.preemptions.get(request_id, 0))
        return report
