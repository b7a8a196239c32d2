"""`KVPressCudaPlatform`: vLLM's CUDA platform with the project's worker and pool-aware scheduler.

Everything CUDA-specific (device discovery, NCCL, memory queries) stays vLLM's; after vLLM's own
`check_and_update_config`, the worker and scheduler are swapped for the plugin's, whose model runner
runs with `device="cuda"` on the project's Triton kernels and sizes the page pool from
`torch.cuda.mem_get_info`. Activated only when compression is asked for (see `activation`).

Not exercised by the test suite: the project's CI has no GPU.
"""

from __future__ import annotations

from typing import Any

from vllm.platforms.cuda import CudaPlatform
from vllm.platforms.interface import PlatformEnum

from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.vllm_plugin.config import UnsupportedConfigError, apply_kvpress_config, settle_runner
from vllm_kvpress_ext.vllm_plugin.contexts import contexts_kept
from vllm_kvpress_ext.vllm_plugin.platform import prompt_length, validate_kvpress_request
from vllm_kvpress_ext.vllm_plugin.request_policy import default_policy

# vLLM picks NVML- or runtime-based device queries at import; subclass whichever it chose.
_CudaBase: Any = CudaPlatform


class KVPressCudaPlatform(_CudaBase):
    _enum = PlatformEnum.CUDA  # vLLM's CUDA code paths key on is_cuda(); this is CUDA with another worker
    default_policy: KVPolicy | None = None  # the server's, for the requests that name no policy of their own
    contexts: bool = False  # whether named contexts are kept (vllm_plugin/contexts.py)

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        super().check_and_update_config(vllm_config)
        if settle_runner(vllm_config, on_gpu=True) == "vllm":
            raise UnsupportedConfigError(
                "vllm-kvpress-ext: vLLM's own model runner (kv_runner 'vllm') runs on the CPU platform only so far; "
                "on a GPU the plugin's own runner serves Llama, Mistral, Qwen2 and Qwen3 models"
            )
        apply_kvpress_config(vllm_config)
        cls.default_policy = default_policy(dict(vllm_config.additional_config or {}))
        cls.contexts = contexts_kept(vllm_config, "project")

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: Any) -> None:
        super().validate_request(processed_inputs, params)
        validate_kvpress_request(
            params, prompt_tokens=prompt_length(processed_inputs), contexts=cls.contexts, default=cls.default_policy
        )
