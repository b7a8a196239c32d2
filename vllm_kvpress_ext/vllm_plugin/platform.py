"""`KVPressCpuPlatform`: vLLM's platform for the plugin on the CPU.

vLLM's CUDA wheel has no usable CPU path (`vllm._C` does not load on a CPU torch), so on a CPU-only
host the plugin brings the device side. By default (`kv_runner: vllm`) vLLM's own model runner runs vLLM's
model code over the project's pool, attention backend and policies (`native/`); with `kv_runner: project`
the plugin's worker runs the project's model, page pool and policies. The accelerator hooks vLLM calls at shutdown raise
on a CPU-only torch; they are made no-ops here, where nothing could have been cached on an accelerator.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from vllm.exceptions import VLLMValidationError
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_kvpress_ext.api.policy_spec import policy_fields
from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.vllm_plugin.config import NATIVE_ATTENTION_BACKEND, apply_kvpress_config, settle_runner
from vllm_kvpress_ext.vllm_plugin.contexts import CONTEXT_FIELD, ContextError, check_context, contexts_kept
from vllm_kvpress_ext.vllm_plugin.request_policy import (
    RequestPolicyError,
    default_policy,
    request_policy,
    unsupported_sampling,
)

if TYPE_CHECKING:
    from vllm_kvpress_ext.vllm_plugin.native.support import ModelFacts


def _tolerant(function: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(RuntimeError):
            return function(*args, **kwargs)
        return None

    return call


def _neutralise_accelerator_cache_calls() -> None:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or accelerator.is_available():
        return
    for name in ("empty_cache", "empty_host_cache"):
        function = getattr(accelerator, name, None)
        if function is not None and not getattr(function, "_kvpress_tolerant", False):
            wrapped = _tolerant(function)
            wrapped._kvpress_tolerant = True
            setattr(accelerator, name, wrapped)


_neutralise_accelerator_cache_calls()


def validate_kvpress_request(
    params: Any,
    runner: str = "project",
    facts: ModelFacts | None = None,
    prompt_tokens: int | None = None,
    contexts: bool = False,
    default: KVPolicy | None = None,
) -> None:
    """Refuse, as HTTP 400, a bad per-request policy or a sampling feature the worker lacks. On vLLM's own
    runner (`runner="vllm"`) vLLM's sampler serves every sampling feature, and a policy that needs what that
    runner does not capture yet is refused by name (`native/support.py`). A named context (`kv_prefix_tokens`)
    is checked against the prompt's `prompt_tokens`, whether this server keeps contexts (`contexts.py`) and the
    policy that compresses it (the request's, else the server's `default`)."""
    from vllm.sampling_params import SamplingParams

    if not isinstance(params, SamplingParams):
        raise VLLMValidationError("vllm-kvpress-ext serves text generation only (no pooling)")
    if runner != "vllm":
        refused = unsupported_sampling(params)
        if refused is not None:
            raise VLLMValidationError(refused[1], parameter=refused[0])
    try:
        policy = request_policy(params.extra_args, None)
    except RequestPolicyError as exc:
        raise VLLMValidationError(str(exc), parameter=exc.param or "kv_policy") from None
    if runner == "vllm":
        from vllm_kvpress_ext.vllm_plugin.native.support import ModelFacts, native_refusal

        refusal = native_refusal(policy, facts or ModelFacts())
        if refusal is not None:
            raise VLLMValidationError(refusal, parameter="kv_policy")
    try:
        check_context(
            params.extra_args,
            prompt_tokens if prompt_tokens is not None else 1 << 62,
            policy if policy is not None or policy_fields(params.extra_args) else default,
            runner=runner,
            enabled=contexts,
            prompt_logprobs=params.prompt_logprobs is not None,
        )
    except ContextError as exc:
        raise VLLMValidationError(str(exc), parameter=CONTEXT_FIELD) from None


def prompt_length(processed_inputs: Any) -> int | None:
    """The prompt's token count from the engine input vLLM validates (None where it carries no token ids)."""
    tokens = processed_inputs.get("prompt_token_ids") if isinstance(processed_inputs, dict) else None
    return len(tokens) if tokens is not None else None


class KVPressCpuPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    ray_device_key: str = ""

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "cpu"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        import psutil

        return int(psutil.virtual_memory().total)

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls) -> Any:
        return torch.no_grad()

    @classmethod
    def import_kernels(cls) -> None:
        """Nothing to import: vLLM's compiled ops (`vllm._C`) are never used by this platform."""

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        """One CPU device; nothing to select."""

    # Which runner this process's engine uses (config.RUNNER_KEY): set when the config is checked, read
    # by `validate_request` in the same (API) process.
    runner: str = "project"
    # On vLLM's runner: what it captures for the served model (`native/support.py`), for the policies' refusals.
    facts: ModelFacts | None = None
    # Whether named contexts are kept (`contexts.py`: prefix caching on); the server's default policy (what
    # compresses a context a request names without a policy of its own).
    contexts: bool = False
    default_policy: KVPolicy | None = None

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        cls.runner = settle_runner(vllm_config)
        if cls.runner == "vllm" and vllm_config.model_config is not None:
            from vllm_kvpress_ext.vllm_plugin.native.support import model_facts, with_parallelism

            cls.facts = with_parallelism(model_facts(str(vllm_config.model_config.model)), vllm_config)
        apply_kvpress_config(vllm_config)
        cls.contexts = contexts_kept(vllm_config, cls.runner)
        cls.default_policy = default_policy(dict(vllm_config.additional_config or {}))

    @classmethod
    def validate_request(cls, processed_inputs: Any, params: Any) -> None:
        validate_kvpress_request(
            params, cls.runner, cls.facts, prompt_length(processed_inputs), cls.contexts, cls.default_policy
        )

    @classmethod
    def get_attn_backend_cls(
        cls, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None
    ) -> str:
        """Asked only by vLLM's own model runner (`kv_runner: vllm`): the plugin's torch backend."""
        if getattr(attn_selector_config, "use_mla", False) or getattr(attn_selector_config, "use_sparse", False):
            raise NotImplementedError("vllm-kvpress-ext: MLA and sparse attention have no per-head KV cache to keep")
        return NATIVE_ATTENTION_BACKEND

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)
