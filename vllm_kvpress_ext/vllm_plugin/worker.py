"""`KVPressWorker`: vLLM's worker interface over the project's `ModelRunner`.

vLLM's scheduler decides which requests run each step and how many tokens each; this worker turns
its `SchedulerOutput` into the runner's `Schedule` (prefill chunks and decodes), samples the next
tokens, and reports the real pool back to the scheduler (`PoolReport`). vLLM alone decides when a
request stops, so the runner's requests never stop on their own (`ignore_eos`, unbounded length).

vLLM's own KV cache manager is given a dummy spec (one layer name, one KV head of size 1) and enough
blocks for `max_num_seqs x max_model_len`, so it never limits anything; starting and preempting requests
follow the real pool through `KVPressScheduler`.

With prefix caching on, the runner keeps a compressed prefix store with automatic matching: every
finished request's cache stays as a session entry, and a request the scheduler promised a stored
prefix to (`SchedulerOutput.kvpress_attach`: entry and length, which vLLM counts as computed) starts
from a fork of it and runs the rest of its prompt as decode steps, all within the step vLLM scheduled
them in. Should the entry be gone, the worker computes those tokens itself in the same step, so vLLM's
count stays true either way.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from vllm.v1.outputs import LogprobsLists, LogprobsTensors, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_kvpress_ext.api.policy_spec import policy_label
from vllm_kvpress_ext.api.usage import kv_figures
from vllm_kvpress_ext.engine.model_runner import (
    DEFAULT_KV_MEMORY,
    ModelRunner,
    RunnerOutput,
    Schedule,
    ScheduledChunk,
)
from vllm_kvpress_ext.engine.origins import LeasedPrefix
from vllm_kvpress_ext.engine.prefix_store import PrefixLease
from vllm_kvpress_ext.engine.request import Request, RequestStatus
from vllm_kvpress_ext.engine.sampler import record_logprobs, sample
from vllm_kvpress_ext.engine.sampling_params import SamplingParams
from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.vllm_plugin.config import MAX_CACHED_PREFIXES_KEY, prefix_matching_mode
from vllm_kvpress_ext.vllm_plugin.contexts import named_context
from vllm_kvpress_ext.vllm_plugin.gguf_model import gguf_source
from vllm_kvpress_ext.vllm_plugin.report import PoolReport
from vllm_kvpress_ext.vllm_plugin.request_policy import default_policy, request_policy

logger = logging.getLogger("vllm.kvpress.worker")

DUMMY_LAYER = "kvpress.dummy"
# vLLM decides when requests stop; the runner's requests must never stop first.
_UNBOUNDED = 1 << 30
# A stored prefix promised to a request: a lease on its entry, and the prompt tokens it gives.
_Attach = tuple[PrefixLease, int]


def runner_sampling_params(params: Any) -> SamplingParams:
    """vLLM's sampling parameters as the runner's sampler takes them (unsupported ones were refused earlier).

    The runner never stops a request (`ignore_eos`, unbounded length): vLLM does. `min_tokens` still needs
    the tokens vLLM would stop on, which its input processor gathered in `all_stop_token_ids` (EOS unless
    ignored, and `stop_token_ids`): the sampler holds exactly those back until `min_tokens` are out.
    """
    return SamplingParams(
        max_tokens=_UNBOUNDED,
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=max(int(params.top_k or 0), 0),
        min_p=float(params.min_p),
        seed=params.seed,
        stop_token_ids=tuple(sorted(params.all_stop_token_ids)) if params.min_tokens else (),
        ignore_eos=True,
        repetition_penalty=float(params.repetition_penalty),
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        min_tokens=int(params.min_tokens),
        # vLLM's server has turned the keys into ids and clamped the values to [-100, 100].
        logit_bias=tuple((int(token), float(bias)) for token, bias in (params.logit_bias or {}).items()),
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
    )


def _weight_bytes(model_path: Path, dtype: torch.dtype | str) -> int:
    """Device bytes the weights will take: safetensors as stored; a GGUF file's tensors dequantised to `dtype`."""
    if model_path.is_dir():
        return sum(f.stat().st_size for f in model_path.glob("*.safetensors"))
    from vllm_kvpress_ext.models import load_config
    from vllm_kvpress_ext.models.gguf_file import open_gguf
    from vllm_kvpress_ext.models.loader import resolve_dtype

    gguf = open_gguf(model_path)
    elements = sum(math.prod(gguf.tensor_shape(name)) for name in gguf.tensor_names())
    return elements * torch.empty((), dtype=resolve_dtype(dtype, load_config(model_path))).element_size()


class KVPressWorker(WorkerBase):
    def __init__(
        self,
        vllm_config: Any,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.requests: dict[str, Request] = {}
        self.prompt_logprobs_sent: set[str] = set()  # requests whose prompt logprobs went out (once each)
        self.runner: ModelRunner | None = None
        self.default_policy: KVPolicy | None = None
        # Requests vLLM counts as having computed tokens that no stored prefix gave them: computed from 0.
        self.catch_up: dict[str, int] = {}
        self.reported_prefixes: set[str] = set()  # stored prefix keys the scheduler has been told of

    # ------------------------------------------------------------------ lifecycle

    def init_device(self) -> None:
        if self.current_platform.device_type == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("vllm-kvpress-ext loads real weights only")
        model = self.model_config
        model_dir = Path(model.model)
        if not model_dir.is_dir():
            raise ValueError(
                f"vllm-kvpress-ext serves a local model directory or a .gguf file; {model.model!r} is neither"
            )
        model_path = gguf_source(model_dir) or model_dir  # a GGUF file's prepared directory names the file
        additional: dict[str, Any] = dict(cast(dict[str, Any], self.vllm_config.additional_config or {}))
        self.default_policy = default_policy(additional)
        assert self.device is not None
        num_pages, kv_memory = self._pool_size(additional, model_path)
        matching = prefix_matching_mode(additional)
        self.runner = ModelRunner(
            model_path,
            dtype=model.dtype,
            device=self.device,
            num_pages=num_pages,
            kv_memory=kv_memory,
            page_size=self.cache_config.block_size,
            max_num_seqs=self.scheduler_config.max_num_seqs,
            max_cached_prefixes=int(additional.get(MAX_CACHED_PREFIXES_KEY, 16)) if matching is not None else 0,
            prefix_matching=matching or "named",
        )
        logger.info(
            "vllm-kvpress-ext: %d KV pages of %d tokens (%d bytes each); default policy %s",
            self.runner.total_pages,
            self.runner.page_size,
            self.runner.page_bytes,
            policy_label(self.default_policy),
        )
        if self.device.type == "cpu" and not logging.getLogger("vllm_kvpress_ext").isEnabledFor(logging.INFO):
            # The runner logs its CPU paths where this package's own logger is on; under vLLM, through vLLM's.
            logger.info("vllm-kvpress-ext: CPU paths: %s", self.runner.cpu_paths())

    def _pool_size(self, additional: dict[str, Any], model_path: Path) -> tuple[int | None, int | None]:
        """(num_pages, kv_memory): `kv_num_pages` in additional_config, else `--kv-cache-memory-bytes`,
        else on CUDA the free device memory within `--gpu-memory-utilization`, else the embedded default."""
        if "kv_num_pages" in additional:
            return int(additional["kv_num_pages"]), None
        if self.cache_config.kv_cache_memory_bytes:
            return None, int(self.cache_config.kv_cache_memory_bytes)
        if self.device is not None and self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            reserve = total * (1.0 - self.cache_config.gpu_memory_utilization)
            weights = _weight_bytes(model_path, self.model_config.dtype)  # loaded after this
            return None, max(int(free - reserve - weights), 1 << 20)
        return None, DEFAULT_KV_MEMORY

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return {DUMMY_LAYER: self._dummy_spec()}

    def _dummy_spec(self) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=self.cache_config.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )

    def get_supported_kv_cache_layouts(self) -> list[str]:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return [layout.name for layout in KVCacheLayout]

    def determine_available_memory(self) -> int:
        """Room for vLLM's dummy blocks only: enough that its block manager never limits scheduling."""
        blocks_per_request = math.ceil(self.model_config.max_model_len / self.cache_config.block_size) + 1
        blocks = self.scheduler_config.max_num_seqs * blocks_per_request + 1
        return blocks * self._dummy_spec().page_size_bytes

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        """vLLM's blocks are bookkeeping only; the real cache is the runner's page pool."""

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        return None

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def get_model(self) -> torch.nn.Module:
        assert self.runner is not None
        return self.runner.model

    def get_cache_block_size_bytes(self) -> int:
        assert self.runner is not None
        return self.runner.page_bytes

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self.requests.clear()
        self.runner = None

    # ------------------------------------------------------------------ stepping

    def execute_model(self, scheduler_output: Any) -> ModelRunnerOutput:
        runner = self.runner
        assert runner is not None
        pinned = self._pin_attachments(scheduler_output, {})
        self._forget(scheduler_output)  # finished requests' sessions are stored here: pin those promised too
        pinned = self._pin_attachments(scheduler_output, pinned)
        runner.free_pages_for(int(getattr(scheduler_output, "kvpress_reserved", 0)))  # unused stored prefixes go first
        failed = self._start_requests(scheduler_output, pinned)
        schedule, tails = self._schedule(scheduler_output, failed)
        first = runner.execute(schedule)
        gone = {failure.request.request_id for failure in first.failed}
        results = [first] + [
            self._run_tail(request, count) for request, count in tails if request.request_id not in gone
        ]
        sampled: dict[str, int] = {}
        for result in results:
            if result.logits is not None:
                tokens = sample(result.logits, result.sample, runner.config.eos_token_ids)
                record_logprobs(result.sample, result.logits, tokens)
                for request, token in zip(result.sample, tokens, strict=True):
                    request.output_token_ids.append(token)
                    sampled[request.request_id] = token
            for failure in result.failed:
                failed[failure.request.request_id] = failure.message
                runner.release(self.requests.pop(failure.request.request_id))
        req_ids = list(scheduler_output.num_scheduled_tokens)
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[sampled[rid]] if rid in sampled else [] for rid in req_ids],
        )
        output.logprobs = self._sampled_logprobs(req_ids, sampled)
        output.prompt_logprobs_dict = self._prompt_logprobs(sampled)
        output.kvpress = self._report(sampled, failed)  # type: ignore[attr-defined]
        return output

    def _schedule(self, scheduler_output: Any, failed: dict[str, str]) -> tuple[Schedule, list[tuple[Request, int]]]:
        """vLLM's scheduled token counts as the runner's schedule, plus the prompt tails of attached requests
        (more than one token for a running request): one prefill chunk where the runner allows it
        (`runs_tail_as_chunk`), else decode steps of their own."""
        schedule = Schedule()
        tails: list[tuple[Request, int]] = []
        for request_id, count in scheduler_output.num_scheduled_tokens.items():
            if request_id in failed:
                continue
            request = self.requests[request_id]
            computed = self.catch_up.pop(request_id, None)
            if request.status is RequestStatus.PREFILLING:
                start = request.seat.num_processed if computed is None else computed
                # A named context (`compress_after`): the chunk stops where the policy compresses, and the question
                # after it runs over the compressed cache, in the same step.
                end = min(start + count, request.prefill_target)
                schedule.prefill.append(ScheduledChunk(request, request.seat.num_processed, end))
                if end < start + count:
                    tails.append((request, start + count - end))
            elif count == 1:
                schedule.decode.append(request)
            elif self.runner is not None and self.runner.runs_tail_as_chunk(request):
                schedule.prefill.append(
                    ScheduledChunk(request, request.seat.num_processed, request.seat.num_processed + count)
                )
            else:
                tails.append((request, count))
        return schedule, tails

    def _run_tail(self, request: Request, count: int) -> RunnerOutput:
        """`count` prompt tokens of a request that has compressed (after an attached prefix or its own context): one
        prefill chunk where the runner allows it (`runs_tail_as_chunk`), else one decode step each."""
        assert self.runner is not None
        if self.runner.runs_tail_as_chunk(request):
            start = request.seat.num_processed
            return self.runner.execute(Schedule(prefill=[ScheduledChunk(request, start, start + count)]))
        result = RunnerOutput()
        for _ in range(count):
            result = self.runner.execute(Schedule(decode=[request]))
            if result.failed:
                break
        return result

    def _pin_attachments(self, scheduler_output: Any, pinned: dict[str, _Attach]) -> dict[str, _Attach]:
        """`pinned` plus the stored prefixes promised this step that exist now, each leased for its request
        before anything may drop it (the scheduler may promise a session its request left last step)."""
        runner = self.runner
        promised: dict[str, tuple[str, int]] = getattr(scheduler_output, "kvpress_attach", None) or {}
        if runner is None:
            return {}
        more = {}
        for rid, (key, length) in promised.items():
            lease = runner.lease_prefix(key) if rid not in pinned else None
            if lease is not None:
                more[rid] = (lease, length)
        return {**pinned, **more}

    def _sampled_logprobs(self, req_ids: list[str], sampled: dict[str, int]) -> LogprobsLists | None:
        """vLLM's per-step logprobs: row i for `req_ids[i]`, column 0 the sampled token, then its top-k."""
        asking = [rid for rid in req_ids if rid in sampled and self.requests[rid].params.logprobs is not None]
        if not asking:
            return None
        width = 1 + max(int(self.requests[rid].params.logprobs or 0) for rid in asking)
        token_ids = np.zeros((len(req_ids), width), dtype=np.int64)
        logprobs = np.full((len(req_ids), width), -np.inf, dtype=np.float32)
        ranks = np.zeros(len(req_ids), dtype=np.int64)
        index = {rid: i for i, rid in enumerate(req_ids)}
        for rid in asking:
            entry = self.requests[rid].output_logprobs[-1]
            row = index[rid]
            token_ids[row, 0], logprobs[row, 0], ranks[row] = entry.token_id, entry.logprob, entry.rank
            for column, (alt_id, alt_logprob) in enumerate(entry.top, start=1):
                token_ids[row, column], logprobs[row, column] = alt_id, alt_logprob
        return LogprobsLists(token_ids, logprobs, ranks)

    def _prompt_logprobs(self, sampled: dict[str, int]) -> dict[str, LogprobsTensors | None]:
        """The whole prompt's logprobs, sent once, in the step that ends its prefill (vLLM sends no partial
        prefill output): row p scores prompt token p + 1, column 0 that token, then the top-k."""
        out: dict[str, LogprobsTensors | None] = {}
        for rid in sampled:
            request = self.requests[rid]
            k = request.params.prompt_logprobs
            if k is None or rid in self.prompt_logprobs_sent:
                continue
            self.prompt_logprobs_sent.add(rid)
            entries = request.prompt_logprobs[1:]
            token_ids = torch.zeros((len(entries), k + 1), dtype=torch.int64)
            logprobs = torch.full((len(entries), k + 1), float("-inf"), dtype=torch.float32)
            ranks = torch.zeros(len(entries), dtype=torch.int64)
            for row, entry in enumerate(entries):
                assert entry is not None  # only the first prompt token has none
                token_ids[row, 0], logprobs[row, 0], ranks[row] = entry.token_id, entry.logprob, entry.rank
                for column, (alt_id, alt_logprob) in enumerate(entry.top, start=1):
                    token_ids[row, column], logprobs[row, column] = alt_id, alt_logprob
            out[rid] = LogprobsTensors(token_ids, logprobs, ranks)
        return out

    def _forget(self, scheduler_output: Any) -> None:
        """Free finished requests; free preempted ones but keep them for their recomputation."""
        runner = self.runner
        assert runner is not None
        for request_id in scheduler_output.finished_req_ids:
            self.prompt_logprobs_sent.discard(request_id)
            request = self.requests.pop(request_id, None)
            if request is not None:
                runner.keep_session(request)  # with prefix caching on: for the conversation's next turn
                runner.release(request)
        for request_id in scheduler_output.preempted_req_ids or ():
            request = self.requests.get(request_id)
            if request is not None:
                runner.preempt(request)

    def _start_requests(self, scheduler_output: Any, pinned: dict[str, _Attach]) -> dict[str, str]:
        """Add new and resumed requests to the runner; those that cannot be added fail alone (id -> why).

        `pinned`: the stored prefix (a lease on its entry, length) each request was promised."""
        runner = self.runner
        assert runner is not None
        failed: dict[str, str] = {}
        for new in scheduler_output.scheduled_new_reqs:
            plan = pinned.pop(new.req_id, None)
            try:
                policy = request_policy(new.sampling_params.extra_args, self.default_policy)
                request = runner.new_request(
                    new.req_id,
                    list(new.prompt_token_ids),
                    runner_sampling_params(new.sampling_params),
                    policy,
                    max_model_len=self.model_config.max_model_len,
                    max_new_tokens=new.sampling_params.max_tokens,
                    compress_after=named_context(new.sampling_params.extra_args, policy, len(new.prompt_token_ids)),
                )
                self._start(request, new.num_computed_tokens, plan)
                plan = None
            except Exception as exc:
                failed[new.req_id] = f"{type(exc).__name__}: {exc}"
                continue
            finally:
                if plan is not None:
                    plan[0].release()
            self.requests[new.req_id] = request
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            if request_id not in cached.resumed_req_ids:
                continue
            request = self.requests[request_id]
            tokens = cached.all_token_ids[request_id]
            try:
                request.output_token_ids = list(tokens[len(request.prompt_token_ids) :])
                self._start(request, cached.num_computed_tokens[index], pinned.pop(request_id, None))
            except Exception as exc:
                failed[request_id] = f"{type(exc).__name__}: {exc}"
                del self.requests[request_id]
        return failed

    def _start(self, request: Request, computed: int, plan: _Attach | None) -> None:
        """Give the request its row: a fork of the promised stored prefix, or a fresh one. vLLM counts
        `computed` tokens as done; without the prefix they are computed in the request's first chunk."""
        runner = self.runner
        assert runner is not None
        if plan is not None and computed == plan[1] and runner.start(request, LeasedPrefix(*plan)):
            return
        if plan is not None:  # a lease `start` did not take (released there if it ran: a no-op)
            plan[0].release()
        runner.start(request)
        if computed:
            self.catch_up[request.request_id] = computed

    def _report(self, sampled: dict[str, int], failed: dict[str, str]) -> PoolReport:
        runner = self.runner
        assert runner is not None
        num_layers, num_kv_heads = runner.config.num_hidden_layers, runner.config.num_key_value_heads
        report = PoolReport(
            pages_total=runner.total_pages,
            pages_free=runner.free_pages,
            page_size=runner.page_size,
            pages_per_token_block=num_layers * num_kv_heads,
            page_bytes=runner.page_bytes,
            failed=failed,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
        )
        for request_id, request in self.requests.items():
            if request.seat.row is None:
                continue
            report.pages_held[request_id] = runner.pages_held(request)
            if request.status is RequestStatus.RUNNING:
                # One token, or an attached request's prompt tokens still to run (vLLM schedules them at once).
                ahead = max(1, request.num_tokens - request.seat.num_processed)
                report.decode_pages[request_id] = runner.pages_to_decode([request], ahead)
            if request_id in sampled:
                runner.update_kv_stats(request)
                report.kv[request_id] = kv_figures(
                    policy_label(request.policy), request.seat.kv, request.num_preemptions
                )
        self._report_prefixes(report)
        return report

    def _report_prefixes(self, report: PoolReport) -> None:
        """What the scheduler's mirror needs of the prefix store: entries added and dropped, evictable pages;
        and its figures for the metrics."""
        runner = self.runner
        view = runner.prefix_store_view(self.reported_prefixes) if runner is not None else None
        if runner is None or view is None:
            return
        report.add_store(view)
        self.reported_prefixes = set(view.keys)
        for request_id, request in self.requests.items():
            boundary = runner.session_boundary(request)
            if request.seat.row is not None and boundary is not None:
                report.prefix_sessions[request_id] = (boundary, request.seat.num_processed)
