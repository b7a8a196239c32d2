"""`KVPressWorker`: vLLM's worker interface over the project's `ModelRunner`.

vLLM's scheduler decides which requests run each step and how many tokens each; this worker turns
its `SchedulerOutput` into the runner's `Schedule` (prefill chunks and decodes), samples the next
tokens, and reports the real pool back to the scheduler (`PoolReport`). vLLM alone decides when a
request stops, so the runner's requests never stop on their own (`ignore_eos`, unbounded length).

vLLM's own KV cache manager is given a dummy spec (one layer name, one KV head of size 1) and enough
blocks for `max_num_seqs x max_model_len`, so it never limits anything; starting and preempting requests
follow the real pool through `KVPressScheduler`.
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
from vllm_kvpress_ext.engine.model_runner import DEFAULT_KV_MEMORY, ModelRunner, Schedule, ScheduledChunk
from vllm_kvpress_ext.engine.request import Request, RequestStatus
from vllm_kvpress_ext.engine.sampler import record_logprobs, sample
from vllm_kvpress_ext.engine.sampling_params import SamplingParams
from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.vllm_plugin.gguf_model import gguf_source
from vllm_kvpress_ext.vllm_plugin.report import PoolReport
from vllm_kvpress_ext.vllm_plugin.request_policy import default_policy, request_policy

logger = logging.getLogger("vllm.kvpress.worker")

DUMMY_LAYER = "kvpress.dummy"
# vLLM decides when requests stop; the runner's requests must never stop first.
_UNBOUNDED = 1 << 30


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
        self.runner = ModelRunner(
            model_path,
            dtype=model.dtype,
            device=self.device,
            num_pages=num_pages,
            kv_memory=kv_memory,
            page_size=self.cache_config.block_size,
            max_num_seqs=self.scheduler_config.max_num_seqs,
        )
        logger.info(
            "vllm-kvpress-ext: %d KV pages of %d tokens (%d bytes each); default policy %s",
            self.runner.total_pages,
            self.runner.page_size,
            self.runner.page_bytes,
            policy_label(self.default_policy),
        )

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
        self._forget(scheduler_output)
        failed = self._start_requests(scheduler_output)
        schedule = Schedule()
        for request_id, count in scheduler_output.num_scheduled_tokens.items():
            if request_id in failed:
                continue
            request = self.requests[request_id]
            if request.status is RequestStatus.PREFILLING:
                schedule.prefill.append(ScheduledChunk(request, request.num_processed, request.num_processed + count))
            else:
                if count != 1:
                    raise RuntimeError(f"request {request_id} decodes one token per step, was scheduled {count}")
                schedule.decode.append(request)
        result = runner.execute(schedule)
        sampled: dict[str, int] = {}
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
                runner.release(request)
        for request_id in scheduler_output.preempted_req_ids or ():
            request = self.requests.get(request_id)
            if request is not None:
                runner.preempt(request)

    def _start_requests(self, scheduler_output: Any) -> dict[str, str]:
        """Add new and resumed requests to the runner; those that cannot be added fail alone (id -> why)."""
        runner = self.runner
        assert runner is not None
        failed: dict[str, str] = {}
        for new in scheduler_output.scheduled_new_reqs:
            try:
                if new.num_computed_tokens:
                    raise RuntimeError("prefix caching must be off; a new request arrived half computed")
                policy = request_policy(new.sampling_params.extra_args, self.default_policy)
                request = runner.new_request(
                    new.req_id,
                    list(new.prompt_token_ids),
                    runner_sampling_params(new.sampling_params),
                    policy,
                    max_model_len=self.model_config.max_model_len,
                    max_new_tokens=new.sampling_params.max_tokens,
                )
                runner.add(request)
            except Exception as exc:
                failed[new.req_id] = f"{type(exc).__name__}: {exc}"
                continue
            self.requests[new.req_id] = request
        cached = scheduler_output.scheduled_cached_reqs
        for request_id in cached.resumed_req_ids:
            request = self.requests[request_id]
            tokens = cached.all_token_ids[request_id]
            try:
                runner.resume(request, list(tokens[len(request.prompt_token_ids) :]))
            except Exception as exc:
                failed[request_id] = f"{type(exc).__name__}: {exc}"
                del self.requests[request_id]
        return failed

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
            if request.row is None:
                continue
            report.pages_held[request_id] = runner.pages_held(request)
            if request.status is RequestStatus.RUNNING:
                report.decode_pages[request_id] = runner.pages_to_decode([request])
            if request_id in sampled:
                runner.update_kv_stats(request)
                report.kv[request_id] = kv_figures(policy_label(request.policy), request.kv, request.num_preemptions)
        return report
