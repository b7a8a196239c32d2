"""`VllmRunnerWorker`: vLLM's GPU worker, started on the CPU with the plugin's `KVPressModelRunner`.

vLLM's own `CPUWorker` cannot start here: its constructor calls `torch.ops._C.init_cpu_memory_env`,
which only vLLM's CPU build has. Everything else the CPU worker does is vLLM's GPU worker with a CPU
runner, so this worker is that: vLLM's `Worker`, whose `init_device` starts the distributed group
(gloo), seeds, and builds the runner (`native/runner.py`: vLLM's `CPUModelRunner` with the project's
page pool as its KV cache). vLLM's model code then runs its portable torch paths on this out-of-tree
platform (`CustomOp.forward_oot` falls back to `forward_native`), and attention goes to
`native/attention.py`.

Around each step the worker keeps the pool in step with the scheduler (`NativePool.begin_step`: rows
for new and resumed requests, pages back from finished and preempted ones) and attaches the pool's
report to the step's output (`ModelRunnerOutput.kvpress`), from which `KVPressScheduler` budgets the
next step and the finished requests' KV figures reach `usage`.

Memory: vLLM's block planner is told it has room for every block its scheduler could ask for
(`determine_available_memory`); nothing is allocated for those blocks. The pool's size is the runner's
(`kv_num_pages`, `--kv-cache-memory-bytes`, or 1 GiB).
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import torch
from vllm.distributed import get_pp_group
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from vllm_kvpress_ext.vllm_plugin.native import adapter, moe, tensor_parallel
from vllm_kvpress_ext.vllm_plugin.native.runner import KVPressModelRunner

logger = logging.getLogger("vllm.kvpress.worker")


class VllmRunnerWorker(Worker):
    model_runner: KVPressModelRunner
    peak_pages = 0  # the most pool pages held at the end of a step since the worker started

    def kvpress_worker_stats(self, restart_peak: bool = False) -> dict[str, Any]:
        """This worker's pool high-water mark (since it started, or the last `restart_peak`) and what its policies
        exchanged with the other tensor-parallel workers (`collective_rpc("kvpress_worker_stats")`)."""
        pool = self.model_runner.pool
        page_bytes = pool.cache.pool.bytes_per_page if pool is not None else 0
        exchanged = tensor_parallel.EXCHANGED
        stats = {
            "peak_kv_bytes": self.peak_pages * page_bytes,
            "gathers": exchanged.gathers,
            "exchange_bytes": exchanged.bytes_sent,
            "exchange_seconds": exchanged.seconds,
        }
        if restart_peak:
            self.peak_pages = pool.cache.pool.num_used if pool is not None else 0
        return stats

    def init_device(self) -> None:
        from vllm.utils.torch_utils import set_random_seed

        adapter.install()
        moe.register()
        self.device = torch.device("cpu")
        self.parallel_config.disable_custom_all_reduce = True
        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank, "gloo"
        )
        set_random_seed(self.model_config.seed)
        self.model_runner = KVPressModelRunner(self.vllm_config, self.device)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        # vLLM's GPU worker drops torch to one thread after loading ("no steady-state CPU op benefits from
        # intra-op parallelism" holds where the model runs on a GPU). Here the model runs on these threads:
        # keep the count the worker started with (vLLM's share of the CPUs for this worker).
        threads = torch.get_num_threads()
        super().load_model(load_dummy_weights=load_dummy_weights)
        torch.set_num_threads(threads)
        # On the thread that runs the model: packing probes oneDNN's kernel for the dtype there first.
        packed = adapter.pack_projections(self.model_runner.get_model())
        logger.info("vllm-kvpress-ext: %d projection weights packed for oneDNN", packed)
        runner = self.model_runner
        if not get_pp_group().is_first_rank:
            # vLLM allocates the buffer a later pipeline stage receives its activations in during its profiling run,
            # which this worker does not make (`determine_available_memory`): allocated here instead.
            model: Any = runner.get_model()
            runner.intermediate_tensors = model.make_empty_intermediate_tensors(
                batch_size=runner.max_num_tokens, dtype=self.model_config.dtype, device=self.device
            )

    def determine_available_memory(self) -> int:
        """Room for every block vLLM's scheduler could plan (max_num_seqs requests of max_model_len tokens)
        in every layer: bookkeeping only, the runner allocates none of it."""
        block_size = self.cache_config.block_size
        blocks = self.scheduler_config.max_num_seqs * (math.ceil(self.model_config.max_model_len / block_size) + 1) + 1
        specs = self.model_runner.get_kv_cache_spec()
        return blocks * sum(spec.page_size_bytes for spec in specs.values())

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Eager execution, no graphs to capture: there is nothing to warm up.
        return CompilationTimes(language_model=0.0, encoder=0.0)

    # The pool's tensors are created and updated under vLLM's inference mode (the forward pass allocates and
    # grows them); updating them outside it is an error, so the worker's own pool work runs under it too.
    @torch.inference_mode()
    def execute_model(self, scheduler_output: Any) -> Any:
        pool = self.model_runner.pool
        if pool is not None:
            pool.begin_step(scheduler_output)
        output = super().execute_model(scheduler_output)
        if pool is not None:  # the pass is done (its logits are kept for sampling): the policies run now
            if pool.shard is not None or pool.pipeline_stages > 1:  # every worker runs the same requests' policies,
                # whose gathers (over heads, over stages) pair up
                pool.fail_as_elsewhere(tensor_parallel.agree_on_failures(pool.failed))
            pool.apply_policies()
        return self._with_report(output)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: Any) -> Any:
        return self._with_report(super().sample_tokens(grammar_output))

    def _with_report(self, output: Any) -> Any:
        """The step's output with the pool's report (a copy: vLLM returns one shared empty output)."""
        pool = self.model_runner.pool
        if pool is None or not isinstance(output, ModelRunnerOutput):
            return output
        output = copy.copy(output)
        self.peak_pages = max(self.peak_pages, pool.cache.pool.num_used)
        report = pool.report()
        if pool.shard is not None or pool.pipeline_stages > 1:  # the scheduler reads one worker's: the tightest's
            blocks = pool.prefix_blocks
            kept = (lambda: frozenset(blocks.kept)) if blocks is not None else None
            replicas = 1 if pool.shard is None else pool.shard.replicas
            report = tensor_parallel.merged_report(report, replicas, kept)
            pool.fail_as_elsewhere(report.failed)
        output.kvpress = report
        if report.failed:  # a failed request's token came from zeroed attention: it is not sent
            sampled = list(output.sampled_token_ids)
            for request_id in report.failed:
                index = output.req_id_to_index.get(request_id)
                if index is not None and index < len(sampled):
                    sampled[index] = []
            output.sampled_token_ids = sampled
        return output
