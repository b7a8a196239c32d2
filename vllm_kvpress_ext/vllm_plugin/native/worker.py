"""`VllmRunnerWorker`: vLLM's GPU worker, started on the CPU with vLLM's `CPUModelRunner`.

vLLM's own `CPUWorker` cannot start here: its constructor calls `torch.ops._C.init_cpu_memory_env`,
which only vLLM's CPU build has. Everything else the CPU worker does is vLLM's GPU worker with a CPU
runner, so this worker is that: vLLM's `Worker`, whose `init_device` starts the distributed group
(gloo), seeds, and builds `CPUModelRunner`. vLLM's model code then runs its portable torch paths on
this out-of-tree platform (`CustomOp.forward_oot` falls back to `forward_native`), and attention goes
to `native/attention.py`.

Memory: the KV cache gets `--kv-cache-memory-bytes` (`kv_cache_memory_bytes`) when given, else the
embedded engine's default (1 GiB), rather than vLLM's GPU memory profile, which reads CUDA memory.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from vllm_kvpress_ext.engine.model_runner import DEFAULT_KV_MEMORY
from vllm_kvpress_ext.vllm_plugin.native import adapter


class VllmRunnerWorker(Worker):
    def init_device(self) -> None:
        from vllm.utils.torch_utils import set_random_seed
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        adapter.install()
        self.device = torch.device("cpu")
        self.parallel_config.disable_custom_all_reduce = True
        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank, "gloo"
        )
        set_random_seed(self.model_config.seed)
        self.model_runner = CPUModelRunner(self.vllm_config, self.device)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        # vLLM's GPU worker drops torch to one thread after loading ("no steady-state CPU op benefits from
        # intra-op parallelism" holds where the model runs on a GPU). Here the model runs on these threads:
        # keep the count the worker started with (vLLM's share of the CPUs for this worker).
        threads = torch.get_num_threads()
        super().load_model(load_dummy_weights=load_dummy_weights)
        torch.set_num_threads(threads)

    def determine_available_memory(self) -> int:
        configured = self.cache_config.kv_cache_memory_bytes
        return int(configured) if configured else DEFAULT_KV_MEMORY

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Eager execution, no graphs to capture: there is nothing to warm up.
        return CompilationTimes(language_model=0.0, encoder=0.0)
