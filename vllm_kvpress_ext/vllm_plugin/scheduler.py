"""`KVPressScheduler`: vLLM's scheduler, starting and preempting requests by the real per-(layer, KV head) pool.

vLLM's own logic stays in charge (FCFS queue, chunked prefill mixed with decodes, preemption by
recompute of the most recent request); only its answer to "do this request's new tokens fit?" is
changed. `kv_cache_manager.allocate_slots` is gated by a page budget taken from the worker's last
`PoolReport`:

- a request starting (or restarting after preemption) its prefill reserves its prefill peak, by the
  embedded scheduler's rule: the uncompressed prompt, or, when its policy compresses layer by layer
  and vLLM schedules the whole prompt as one chunk, the peak the policy declares
  (`KVPolicy.prefill_peak_pages`; the worker's runner fails a request that needs more, alone), or,
  for an admission policy (WG-KV), the chunked prefill peak it declares for chunks of at most
  vLLM's `max_num_batched_tokens` (`KVPolicy.chunked_prefill_peak_pages`);
- a later prefill chunk costs nothing more (its pages were reserved);
- a decoding request costs exactly the pages its next token allocates (ragged after compression).

A refusal makes vLLM hold the request back or preempt, and each preemption credits the victim's
pages. Pages freed by compression therefore become more concurrent requests under vLLM's own
scheduling. The per-request KV figures the worker reports go back to the client on finished outputs
(`kv_transfer_params["kvpress"]`), and on every output of a request with stop strings, which the API
process may end after any of them; pool gauges and counters go to `metrics`.

With prefix caching on (`--enable-prefix-caching` given explicitly, docs/vllm.md), the worker keeps
the cache of every finished request in its compressed prefix store and reports what it stored and
dropped; this scheduler mirrors the store's index (`PrefixIndex`) and answers vLLM's
`kv_cache_manager.get_computed_blocks` with the tokens a waiting request can attach to (the
embedded engine's automatic matching, docs/prefix_reuse.md), so that vLLM schedules only the rest.
It tells the worker which entry and length it promised (`SchedulerOutput.kvpress_attach`), and the
pages this step needs (`kvpress_reserved`), which the worker frees by dropping unused entries first;
unused entries' pages count as available here, so they go before any running request is preempted.

On vLLM's runner (`kv_runner: vllm`) prefix caching is vLLM's own: its lookup runs as always, and each
hit is cut at the first block the pool does not keep (`kept_prefix_tokens`, from the kept block ids
the reports carry), and, for a request whose policy compresses, at the first position whose prefill its
policy reads (native/prefix_blocks.py). A request that names its context (`kv_prefix_tokens`) is held back
until its context is compressed and stored, by a context build this scheduler queues, then attaches to it
(contexts.py).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from vllm_kvpress_ext.api.policy_spec import policy_fields
from vllm_kvpress_ext.engine.prefix_store import PrefixIndex, session_entry
from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.vllm_plugin.config import RUNNER_KEY
from vllm_kvpress_ext.vllm_plugin.contexts import (
    BUILD_PREFIX,
    context_key,
    context_refusal,
    named_context,
)
from vllm_kvpress_ext.vllm_plugin.metrics import EngineMetrics, replica_metrics_file
from vllm_kvpress_ext.vllm_plugin.native.prefix_blocks import readable_prefix
from vllm_kvpress_ext.vllm_plugin.report import PoolReport
from vllm_kvpress_ext.vllm_plugin.request_policy import default_policy, request_policy

logger = logging.getLogger("vllm.kvpress.scheduler")
_UNSET = object()  # the server's default policy, parsed on first use
_LOOKUPS = 4  # vLLM prefix-cache lookups per request, each after dropping the blocks the pool does not keep


@dataclass
class _ContextBuild:
    """A context being compressed for the requests held back until it is stored (contexts.py)."""

    key: str
    request: Any  # the build's own vLLM request: the context's tokens, the same policy, one output token
    held: list[Any] = field(default_factory=list)


def _count_nothing_cached(request: Any) -> None:
    """Have vLLM report no cached prompt tokens for `request` (its `prefill_stats`, from which the API process takes
    `num_cached_tokens`)."""
    stats = getattr(request, "prefill_stats", None)
    if stats is not None:
        stats.set(num_prompt_tokens=request.num_prompt_tokens, num_local_cached_tokens=0, num_external_cached_tokens=0)


class _PoolGate:
    """vLLM's KV cache manager, except that `allocate_slots` first asks the scheduler's page budget."""

    def __init__(self, manager: Any, scheduler: KVPressScheduler) -> None:
        self._manager = manager
        self._scheduler = scheduler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def get_computed_blocks(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        """The worker's stored prefix (the plugin's own runner), or vLLM's own lookup (vLLM's runner) cut to the
        blocks the pool keeps. (vLLM 0.33 passes a hit-length bound, which goes to its lookup as given.)"""
        attached = self._scheduler.plan_attach(request)
        if attached is not None:
            return self._manager.empty_kv_cache_blocks, attached, 0
        blocks, tokens, boundary = self._manager.get_computed_blocks(request, *args, **kwargs)
        for _ in range(_LOOKUPS):
            kept, stale = self._scheduler.kept_prefix_tokens(request, blocks, tokens)
            if kept == tokens:
                return blocks, tokens, boundary
            if not stale:
                break
            # vLLM hashed blocks that the pool does not keep (a compressing request's): out of its table, so
            # that the same tokens' kept blocks, if any, are found instead.
            self._manager.block_pool.evict_blocks(stale)
            blocks, tokens, boundary = self._manager.get_computed_blocks(request, *args, **kwargs)
        return self._manager.truncate_computed_blocks(blocks, kept), kept, 0

    def allocate_slots(self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        if not self._scheduler.reserve_pages(request, num_new_tokens, kwargs.get("num_new_computed_tokens", 0)):
            return None
        blocks = self._manager.allocate_slots(request, num_new_tokens, *args, **kwargs)
        if blocks is None:
            self._scheduler.refund_pages(request)
        return blocks


class KVPressScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kv_cache_manager = _PoolGate(self.kv_cache_manager, self)  # type: ignore[assignment]
        self.report: PoolReport | None = None
        self.available = 0
        # Pages subtracted from `available` for each request during the current schedule().
        self.charged: dict[str, int] = {}
        # Requests mid-prefill -> the peak reserved for them when they started.
        self.prefill_peaks: dict[str, int] = {}
        self._default_policy: Any = _UNSET
        # Pages of requests finished or aborted since the last report (the worker frees them first thing).
        self.freed_since_report = 0
        self.pending_errors: list[tuple[Any, str]] = []
        self.metrics = EngineMetrics(replica_metrics_file(self.vllm_config))
        # The worker's compressed prefix store as its reports describe it (None until one says it has one),
        # and the attachments promised to vLLM in the current schedule(): request id -> (entry key, tokens).
        self.prefix_mirror: PrefixIndex | None = None
        self.attach_plans: dict[str, tuple[str, int]] = {}
        # Requests that may end on a stop string: the figures their last output carried.
        self.last_figures: dict[str, dict[str, Any]] = {}
        # vLLM's runner: the vLLM block ids whose pages the pool keeps (what vLLM's prefix hits may use).
        self.kept_blocks: frozenset[int] = frozenset()
        # Named contexts (vLLM's runner, prefix caching on; contexts.py): the builds in flight by their request id,
        # and, for each waiting request whose context is stored, that context's key (it attaches to it).
        config = getattr(self, "vllm_config", None)
        additional = dict(getattr(config, "additional_config", None) or {})
        self.named_contexts = additional.get(RUNNER_KEY) == "vllm" and bool(self.cache_config.enable_prefix_caching)
        self.model_dir = str(config.model_config.model) if config is not None and config.model_config else ""
        self.context_builds: dict[str, _ContextBuild] = {}
        self.awaiting_context: dict[str, str] = {}
        # Requests that waited for their context's build: they computed it (through the build) rather than found
        # it cached, so vLLM's cached-token count for them is put back to 0.
        self.waited_for_build: set[str] = set()
        self._contexts_of: dict[str, tuple[str, int, KVPolicy] | None] = {}

    # ------------------------------------------------------------------ budget

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._begin_budget()
        self._refuse_unservable()
        self.attach_plans = {}
        if self.named_contexts:
            self._route_contexts()
        output = super().schedule(*args, **kwargs)
        self.metrics.scheduled(len(output.num_scheduled_tokens))
        output.kvpress_attach = self._promised(output)  # type: ignore[attr-defined]
        output.kvpress_reserved = sum(self.charged.values())  # type: ignore[attr-defined]
        if self.named_contexts:
            # The builds this step starts (the worker stores what they compress), and the stored contexts waiting
            # requests will attach to (the worker holds them, so that nothing evicts them first).
            builds = self.context_builds
            output.kvpress_contexts = {  # type: ignore[attr-defined]
                new.req_id: builds[new.req_id].key for new in output.scheduled_new_reqs if new.req_id in builds
            }
            built_for = set()
            for request_id in output.kvpress_attach:  # type: ignore[attr-defined]
                self.awaiting_context.pop(request_id, None)
                if request_id in self.waited_for_build:
                    self.waited_for_build.discard(request_id)
                    _count_nothing_cached(self.requests[request_id])
                    built_for.add(request_id)
            output.kvpress_built_for = frozenset(built_for)  # type: ignore[attr-defined]  # attaches, not cache hits
            output.kvpress_held = frozenset(self.awaiting_context.values())  # type: ignore[attr-defined]
        return output

    # ------------------------------------------------------------------ named contexts (contexts.py)

    def _context_of(self, request: Any) -> tuple[str, int, KVPolicy] | None:
        """(key, boundary, policy) of the context `request` names, or None (none, or nothing to compress)."""
        request_id = request.request_id
        if request_id not in self._contexts_of:
            policy = self._policy_of(request)
            boundary = named_context(request.sampling_params.extra_args, policy, request.num_prompt_tokens)
            named: tuple[str, int, KVPolicy] | None = None
            # The API process refused what vLLM's runner cannot serve; a request from elsewhere runs without one.
            if (
                boundary is not None
                and policy is not None
                and context_refusal(policy) is None
                and request.sampling_params.prompt_logprobs is None
            ):
                key = context_key(self.model_dir, policy, list(request.prompt_token_ids), boundary)
                named = (key, boundary, policy)
            self._contexts_of[request_id] = named
        return self._contexts_of[request_id]

    def _route_contexts(self) -> None:
        """Each waiting request that names a context (and starts from token 0): to the stored context it attaches
        to, or held back for a build of it, started here if none is in flight."""
        self.awaiting_context = {}
        mirror = self.prefix_mirror
        building = {build.key: build for build in self.context_builds.values()}
        for request in list(self.waiting):
            if request.num_computed_tokens or request.request_id in self.context_builds:
                continue
            named = self._context_of(request)
            if named is None:
                continue
            key, boundary, _ = named
            if mirror is not None and key in mirror.entries:
                self.awaiting_context[request.request_id] = key
                continue
            self.waiting.remove_requests([request])
            build = building.get(key)
            if build is None:
                build = building[key] = self._start_build(key, request, boundary)
            build.held.append(request)

    def _start_build(self, key: str, request: Any, boundary: int) -> _ContextBuild:
        """Queue a request of the scheduler's own that prefills the context alone and stops after one token: its
        policy (the request's, from the same fields) compresses at the context's end, and the worker stores it."""
        fields = policy_fields(request.sampling_params.extra_args)
        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=fields or None)
        build_request = Request(
            f"{BUILD_PREFIX}{uuid.uuid4().hex}",
            list(request.prompt_token_ids[:boundary]),
            params,
            None,
            client_index=request.client_index,
            arrival_time=request.arrival_time,
            priority=request.priority,
            block_hasher=getattr(request, "_block_hasher", None),
        )
        build = _ContextBuild(key, build_request)
        self.context_builds[build_request.request_id] = build
        Scheduler.add_request(self, build_request)
        return build

    def _settle_builds(self, report: PoolReport | None) -> None:
        """Builds that ended: their held requests go back to the queue, to attach to the stored context, or, when
        it was not stored, fail with the reason."""
        mirror = self.prefix_mirror
        for build_id, build in list(self.context_builds.items()):
            if not build.request.is_finished():
                continue
            del self.context_builds[build_id]
            self._credit_finished(build_id)
            stored = mirror is not None and build.key in mirror.entries
            reason = (report.failed.get(build_id) if report is not None else None) or (
                "the context was compressed but could not be stored (every stored context is in use)"
            )
            for request in build.held:
                if request.is_finished():  # aborted while held
                    continue
                if stored:
                    self._enqueue_waiting_request(request)
                    self.waited_for_build.add(request.request_id)
                    continue
                request.status = RequestStatus.FINISHED_ERROR
                self._free_request(request)
                self.pending_errors.append((request, f"its context could not be kept: {reason}"))

    def _held_count(self) -> int:
        return sum(1 for build in self.context_builds.values() for request in build.held if not request.is_finished())

    def get_num_unfinished_requests(self) -> int:
        return super().get_num_unfinished_requests() + self._held_count()

    def _strip_builds(self, outputs: dict[int, EngineCoreOutputs], build_ids: set[str]) -> None:
        """A context build's output is the scheduler's own: no client hears of it."""
        if not build_ids:
            return
        for engine_outputs in outputs.values():
            engine_outputs.outputs = [o for o in engine_outputs.outputs if o.request_id not in build_ids]
            if engine_outputs.finished_requests:
                engine_outputs.finished_requests = set(engine_outputs.finished_requests) - build_ids

    def plan_attach(self, request: Any) -> int | None:
        """Prompt tokens `request` will find computed in a stored prefix (None: none), remembered for the worker."""
        self.attach_plans.pop(request.request_id, None)
        mirror = self.prefix_mirror
        if mirror is None or not mirror.entries or request.sampling_params.prompt_logprobs is not None:
            return None
        if self.named_contexts:  # vLLM's runner: only a request naming a stored context attaches, to that context
            entry = mirror.entries.get(self.awaiting_context.get(request.request_id, ""))
            if entry is None:
                return None
            length = entry.length
        else:  # the plugin's own runner: a named context, or (automatic matching) the longest stored prefix
            policy = self._policy_of(request)
            named = named_context(request.sampling_params.extra_args, policy, request.num_prompt_tokens)
            found = mirror.find(list(request.all_token_ids), policy, named)
            if found is None:
                return None
            entry, length = found
        self.attach_plans[request.request_id] = (entry.key, length)
        return length

    def kept_prefix_tokens(self, request: Any, blocks: Any, tokens: int) -> tuple[int, set[int]]:
        """Of the `tokens` leading tokens vLLM's prefix cache found in `blocks`, those the pool keeps (the run of
        leading blocks it reported) and the request may read, and the found blocks it does not keep. A request
        whose policy compresses reads whole blocks before the first position whose prefill its policy reads
        (`native.prefix_blocks.readable_prefix`)."""
        if tokens == 0:
            return 0, set()
        readable = readable_prefix(self._policy_of(request), request.num_tokens)
        groups = blocks.get_block_ids()
        if len(groups) != 1 or readable < self.block_size:  # one page table for every layer: one KV cache group
            return 0, set()
        held = 0
        while held < len(groups[0]) and groups[0][held] in self.kept_blocks:
            held += 1
        readable_blocks = readable // self.block_size
        return min(tokens, min(held, readable_blocks) * self.block_size), set(groups[0]) - self.kept_blocks

    def _promised(self, output: Any) -> dict[str, tuple[str, int]]:
        """The attachments of the requests this step starts (new or resumed) with computed tokens."""
        promised: dict[str, tuple[str, int]] = {}
        for new in output.scheduled_new_reqs:
            plan = self.attach_plans.get(new.req_id)
            if plan is not None and new.num_computed_tokens == plan[1]:
                promised[new.req_id] = plan
        cached = output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            plan = self.attach_plans.get(request_id)
            if (
                plan is not None
                and request_id in cached.resumed_req_ids
                and cached.num_computed_tokens[index] == plan[1]
            ):
                promised[request_id] = plan
        return promised

    def _begin_budget(self) -> None:
        self.charged = {}
        report = self.report
        if report is None:
            self.available = 0  # the pool's size arrives with the first step's report (see reserve_pages)
            return
        # Unused stored prefixes are dropped (by the worker, least recently used first) before pages run out.
        available = report.pages_free + self.freed_since_report + report.prefix_evictable
        for request_id, peak in self.prefill_peaks.items():
            remaining = max(peak - report.pages_held.get(request_id, 0), 0)
            available -= remaining
            self.charged[request_id] = remaining
        self.available = available
        self.freed_since_report = 0

    def _refuse_unservable(self) -> None:
        """A waiting request whose prefill cannot fit even in an empty pool would block the queue forever."""
        report = self.report
        if report is None:
            return
        for request in list(self.waiting):
            if report.full_prompt_pages(request.num_tokens) <= report.pages_total:
                continue
            self.waiting.remove_requests([request])
            # With output already, it ran out of room mid-generation (the embedded engine's "length").
            status = RequestStatus.FINISHED_LENGTH_CAPPED if request.num_output_tokens else RequestStatus.FINISHED_ERROR
            message = (
                f"request needs {report.full_prompt_pages(request.num_tokens)} KV pages before compression; "
                f"the pool has {report.pages_total}"
            )
            self.pending_errors.append((request, message))
            request.status = status
            self._free_request(request)

    def _policy_of(self, request: Any) -> KVPolicy | None:
        """The request's policy, parsed as the worker parses it (the API process already validated it)."""
        if self._default_policy is _UNSET:
            additional = getattr(getattr(self, "vllm_config", None), "additional_config", None)
            try:
                self._default_policy = default_policy(dict(additional or {}))
            except Exception:
                self._default_policy = None
        try:
            return request_policy(getattr(request.sampling_params, "extra_args", None), self._default_policy)
        except Exception:
            return None  # the worker fails such a request; reserving the full prompt is always safe

    def reserve_pages(self, request: Any, num_new_tokens: int | None = None, cached_tokens: int = 0) -> bool:
        report = self.report
        request_id = request.request_id
        if report is None:
            # No step has run, so the pool's size is not known here yet: start a single request, whose
            # step brings the first report.
            if self.charged:
                return False
            self.charged[request_id] = 0
            return True
        if request.num_computed_tokens == 0:
            # The worker compresses layer by layer only when this first chunk is the whole prefill.
            whole = num_new_tokens is not None and num_new_tokens >= request.num_tokens
            # vLLM never schedules more than this many tokens of one request in a step.
            chunk = getattr(self, "max_num_scheduled_tokens", None)
            # A prompt partly found in vLLM's prefix cache is charged whole too: the kept pages it reads were
            # counted available (a kept block no request reads is dropped when pages run short).
            policy = self._policy_of(request)
            need = report.prefill_pages(request.num_tokens, policy, whole, chunk)
            if request_id in self.awaiting_context and request_id in self.attach_plans:
                # On a fork of a stored context: its question's pages, and a copy of each (layer, KV head)'s
                # partly filled last page, which its first write copies (copy-on-write).
                need = report.full_prompt_pages(request.num_tokens - cached_tokens) + report.pages_per_token_block
            elif cached_tokens and policy is not None:  # its compaction copies the kept pages it moves entries into
                need += report.full_prompt_pages(cached_tokens)
            starting = True
        else:
            need = report.decode_pages.get(request_id, 0)  # 0: a later prefill chunk, reserved when it started
            starting = False
        if need > self.available:
            return False
        self.available -= need
        self.charged[request_id] = self.charged.get(request_id, 0) + need
        if starting:
            self.prefill_peaks[request_id] = need
        return True

    def refund_pages(self, request: Any) -> None:
        self.available += self.charged.pop(request.request_id, 0)
        self.prefill_peaks.pop(request.request_id, None)

    def _preempt_request(self, request: Any, timestamp: float, drop_stale_output: bool = False) -> None:
        request_id = request.request_id
        held = self.report.pages_held.get(request_id, 0) if self.report is not None else 0
        self.available += held + self.charged.pop(request_id, 0)
        self.prefill_peaks.pop(request_id, None)
        self.metrics.preempted_by_pool()
        super()._preempt_request(request, timestamp, drop_stale_output)

    def _credit_finished(self, request_id: str) -> None:
        if self.report is not None:
            self.freed_since_report += self.report.pages_held.pop(request_id, 0)
        self.prefill_peaks.pop(request_id, None)

    def _may_stop_on_text(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        return bool(request is not None and request.sampling_params is not None and request.sampling_params.stop)

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        finished = super().finish_requests(request_ids, finished_status)
        for request in finished or ():
            self._credit_finished(request.request_id)
            figures = self.last_figures.pop(request.request_id, None)
            if figures is not None:  # ended by the API process (a stop string): counted with its last figures
                self.metrics.request_finished(figures)
        # An abort (a stop string seen by the API process, a client gone) may be the engine's last event
        # before it idles: no step follows to update the gauges.
        self.metrics.requests(running=len(self.running), waiting=len(self.waiting))
        return finished

    # ------------------------------------------------------------------ outputs

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, EngineCoreOutputs]:
        report: PoolReport | None = getattr(model_runner_output, "kvpress", None)
        if report is not None:
            self.report = report
            self.freed_since_report = 0
            self._mirror_prefixes(report)
            if report.prefix_blocks is not None:
                self.kept_blocks = report.prefix_blocks
            for request_id in report.decode_pages:  # prefill complete: its reservation became real pages
                self.prefill_peaks.pop(request_id, None)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        build_ids = set(self.context_builds)
        self._strip_builds(outputs, build_ids)
        if report is not None:
            for request_id, message in report.failed.items():
                request = self.requests.get(request_id)
                if request is not None and not request.is_finished():
                    self.finish_requests(request_id, RequestStatus.FINISHED_ERROR)
                    self._emit(outputs, request, FinishReason.ERROR)
                    logger.warning("vllm-kvpress-ext: request %s failed alone: %s", request_id, message)
        if self.context_builds:
            self._settle_builds(report)
        for request, message in self.pending_errors:
            reason = (
                FinishReason.LENGTH if request.status == RequestStatus.FINISHED_LENGTH_CAPPED else FinishReason.ERROR
            )
            self._emit(outputs, request, reason)
            logger.warning("vllm-kvpress-ext: request %s cannot run: %s", request.request_id, message)
        self.pending_errors = []
        kv = report.kv if report is not None else {}
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                figures = kv.get(output.request_id)
                if output.finish_reason is None:
                    # A stop string ends a request in the API process, after this output: it must carry the
                    # figures already (the client's last output is this one), and the metrics count them when
                    # the API process aborts the request here.
                    if figures is not None and self._may_stop_on_text(output.request_id):
                        output.kv_transfer_params = {**(output.kv_transfer_params or {}), "kvpress": figures}
                        self.last_figures[output.request_id] = figures
                    continue
                self._credit_finished(output.request_id)
                self.last_figures.pop(output.request_id, None)
                if figures is not None:
                    output.kv_transfer_params = {**(output.kv_transfer_params or {}), "kvpress": figures}
                    self.metrics.request_finished(figures)
        if report is not None:
            self.metrics.pool(report, running=len(self.running), waiting=len(self.waiting) + self._held_count())
        self._strip_builds(outputs, build_ids)
        return outputs

    def _mirror_prefixes(self, report: PoolReport) -> None:
        if not report.prefix_model:
            return
        if self.prefix_mirror is None:
            self.prefix_mirror = PrefixIndex(report.prefix_model, report.page_size, report.prefix_matching)
        mirror = self.prefix_mirror
        stored = set(report.prefix_keys)
        for key in [k for k in mirror.entries if k not in stored]:
            mirror.unregister(key)
        for entry in report.prefix_added:
            if entry.key not in mirror.entries:
                mirror.register(entry)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        """A finished request's session entry goes into the mirror now: the worker stores it first thing in
        the next step, before it attaches anything, so the next schedule may already promise it."""
        self._contexts_of.pop(request.request_id, None)
        self.waited_for_build.discard(request.request_id)
        report, mirror = self.report, self.prefix_mirror
        written = report.prefix_sessions.pop(request.request_id, None) if report is not None else None
        if mirror is not None and written is not None:
            boundary, length = written
            tokens = list(request.all_token_ids[:length])
            entry = session_entry(mirror.model_dir, mirror.page_size, self._policy_of(request), tokens, boundary)
            if entry is not None and entry.key not in mirror.entries:
                mirror.register(entry)
        return super()._free_request(request, *args, **kwargs)

    @staticmethod
    def _emit(outputs: dict[int, EngineCoreOutputs], request: Any, reason: FinishReason) -> None:
        client = getattr(request, "client_index", 0)
        engine_outputs = outputs.setdefault(client, EngineCoreOutputs(outputs=[]))
        engine_outputs.outputs.append(
            EngineCoreOutput(request_id=request.request_id, new_token_ids=[], finish_reason=reason)
        )
