"""The vLLM configuration every kvpress platform applies, and the features it refuses.

Called from the platforms' `check_and_update_config`, in every vLLM process, before the engine is
built: it swaps in the plugin's worker and scheduler and turns off what cannot be right over a
per-head pool that frees entries (vLLM's own prefix caching would skip prefill of tokens a policy
evicted). Prefix caching is the plugin's own prefix store instead (docs/vllm.md): by default (vLLM's
default, on) it reuses the caches of uncompressed requests exactly; asked for explicitly
(`--enable-prefix-caching`, `LLM(enable_prefix_caching=True)`, or `additional_config["kv_prefix_caching"]`)
it also reuses compressed ones, which changes what a compressing policy sees; `--no-enable-prefix-caching`
turns it off.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_kvpress_ext.api.policy_spec import check_policy_spec

# Under the `vllm.` namespace: vLLM only prints its own loggers' records.
logger = logging.getLogger("vllm.kvpress")

WORKER_CLS = "vllm_kvpress_ext.vllm_plugin.worker.KVPressWorker"
SCHEDULER_CLS = "vllm_kvpress_ext.vllm_plugin.scheduler.KVPressScheduler"
# `additional_config["kv_runner"]`: who runs the model. "vllm" is vLLM's model runner and model zoo over the
# plugin's pool (native/), the default; "project" is the plugin's own runner and pool, which a GPU still
# defaults to for the architectures it runs (vLLM's runner runs on the CPU platform only so far).
RUNNER_KEY = "kv_runner"
RUNNERS = ("project", "vllm")
NATIVE_WORKER_CLS = "vllm_kvpress_ext.vllm_plugin.native.worker.VllmRunnerWorker"
NATIVE_ATTENTION_BACKEND = "vllm_kvpress_ext.vllm_plugin.native.attention.KVPressAttentionBackend"


class UnsupportedConfigError(ValueError):
    """A vLLM feature the plugin does not implement: refused up front, never served wrong."""


def refuse_unsupported(vllm_config: Any, runner: str = "project") -> None:
    parallel = vllm_config.parallel_config
    tensor = parallel.tensor_parallel_size
    if tensor > 1 and runner != "vllm":
        raise UnsupportedConfigError(
            f"vllm-kvpress-ext's own runner (kv_runner 'project') runs one worker: tensor_parallel_size={tensor} "
            "needs vLLM's runner (kv_runner 'vllm'), which serves it on the CPU; on a GPU the plugin runs one worker "
            "so far"
        )
    stages = parallel.pipeline_parallel_size
    if stages > 1 and runner != "vllm":
        raise UnsupportedConfigError(
            f"vllm-kvpress-ext's own runner (kv_runner 'project') runs one worker: pipeline_parallel_size={stages} "
            "needs vLLM's runner (kv_runner 'vllm'), which serves it on the CPU"
        )
    data = getattr(parallel, "data_parallel_size", 1)
    if data > 1 and runner != "vllm":
        raise UnsupportedConfigError(
            f"vllm-kvpress-ext's own runner (kv_runner 'project') does not serve data_parallel_size={data}: it needs "
            "vLLM's runner (kv_runner 'vllm'), which serves it on the CPU; on a GPU, run one replica per GPU as pods"
        )
    model = vllm_config.model_config
    if tensor > 1 and model is not None:
        heads = int(getattr(model.hf_text_config, "num_attention_heads", 0) or 0)
        kv_heads = model.get_total_num_kv_heads()
        if heads % tensor or (kv_heads % tensor and tensor % kv_heads):
            raise UnsupportedConfigError(
                f"tensor_parallel_size={tensor} does not divide this model's {heads} attention heads and "
                f"{kv_heads} KV heads (the KV heads must divide by it, or it by them)"
            )
    if vllm_config.speculative_config is not None:
        raise UnsupportedConfigError("vllm-kvpress-ext does not support speculative decoding yet")
    if vllm_config.lora_config is not None:
        raise UnsupportedConfigError("vllm-kvpress-ext does not support LoRA adapters yet")
    if vllm_config.kv_transfer_config is not None:
        raise UnsupportedConfigError("vllm-kvpress-ext does not support KV transfer connectors")
    if model is not None and getattr(model, "runner_type", "generate") != "generate":
        raise UnsupportedConfigError(f"vllm-kvpress-ext only generates text (runner {model.runner_type!r})")


PREFIX_CACHING_KEY = "kv_prefix_caching"
MAX_CACHED_PREFIXES_KEY = "kv_max_cached_prefixes"


def check_prefix_caching_settings(additional: dict[str, Any]) -> bool:
    """Whether the plugin's prefix store is on; its settings in `additional_config` checked."""
    enabled = additional.get(PREFIX_CACHING_KEY, False)
    if not isinstance(enabled, bool):
        raise UnsupportedConfigError(f"additional_config {PREFIX_CACHING_KEY} must be true or false, got {enabled!r}")
    capacity = additional.get(MAX_CACHED_PREFIXES_KEY, 16)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise UnsupportedConfigError(
            f"additional_config {MAX_CACHED_PREFIXES_KEY} must be an integer >= 1, got {capacity!r}"
        )
    return enabled


def prefix_matching_mode(additional: dict[str, Any]) -> str | None:
    """How the plugin's prefix store matches (`PREFIX_MATCHING_MODES`), or None when it is off.

    Unset (vLLM's default, prefix caching on): "named", which reuses the caches of finished uncompressed
    requests exactly, as vLLM's own prefix caching would, and nothing compressed. Asked for explicitly:
    "auto", which also attaches compressed caches by their tokens (the next turn of a conversation). Turned
    off explicitly (`--no-enable-prefix-caching`): None.
    """
    if PREFIX_CACHING_KEY not in additional:
        check_prefix_caching_settings(additional)
        return "named"
    return "auto" if check_prefix_caching_settings(additional) else None


def record_explicit_prefix_caching(engine_args: Any) -> None:
    """`EngineArgs.enable_prefix_caching` is None unless the user set it: an explicit choice goes to
    `additional_config["kv_prefix_caching"]` (`prefix_matching_mode` reads it); vLLM's default is no choice."""
    if engine_args.enable_prefix_caching is not None:
        choice = bool(engine_args.enable_prefix_caching)
        engine_args.additional_config = {**dict(engine_args.additional_config or {}), PREFIX_CACHING_KEY: choice}


#: The architectures the plugin's own runner runs (`kv_runner: project`), and on a GPU runs by default.
PROJECT_RUNNER_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def chosen_runner(additional: dict[str, Any], architectures: Any = None, on_gpu: bool = False) -> str:
    """`additional_config["kv_runner"]`, checked; unset, "vllm" (vLLM's model runner), except on a GPU, where
    that runner does not run yet: there "project" for a model the plugin's own runner runs (or whose
    architectures are not known yet)."""
    runner = additional.get(RUNNER_KEY)
    if runner is None:
        own = not architectures or bool(set(architectures) & set(PROJECT_RUNNER_ARCHITECTURES))
        return "project" if on_gpu and own else "vllm"
    if runner not in RUNNERS:
        raise UnsupportedConfigError(f"additional_config {RUNNER_KEY} must be one of {RUNNERS}, got {runner!r}")
    return str(runner)


def settle_runner(vllm_config: Any, on_gpu: bool = False) -> str:
    """Choose the runner once, in the process that checks the config, and record it in `additional_config`, so
    that every process built from this config (engine core, workers) and the API server agree."""
    model = vllm_config.model_config
    additional = dict(vllm_config.additional_config or {})
    architectures = getattr(model, "architectures", None) if model is not None else None
    runner = chosen_runner(additional, architectures, on_gpu)
    if RUNNER_KEY not in additional:
        logger.info(
            "vllm-kvpress-ext: %s runs the model over the plugin's pool (kv_runner %r; set it to choose)",
            "vLLM's model runner" if runner == "vllm" else "the plugin's own runner",
            runner,
        )
    additional[RUNNER_KEY] = runner
    vllm_config.additional_config = additional
    return runner


def moe_refusal(architectures: list[str], quantization: str | None) -> str | None:
    """Why vLLM's runner cannot run this mixture-of-experts model on the plugin's CPU platform, or None: vLLM's
    fused-MoE layer has no experts kernel or router op there, and the plugin's torch stand-ins
    (`native/moe.py`) cover plain top-k routed SiLU experts only."""
    from vllm_kvpress_ext.vllm_plugin.native.support import SUPPORTED_MOE

    if quantization is not None:
        return f"kv_runner 'vllm' runs mixture-of-experts models unquantized only on this platform, not {quantization}"
    if not set(architectures) & set(SUPPORTED_MOE):
        return (
            f"kv_runner 'vllm' runs the mixture-of-experts layers of {', '.join(SUPPORTED_MOE)} on this platform, "
            f"not {', '.join(architectures) or 'this model'}'s (shared experts or grouped routing)"
        )
    return None


def apply_native_config(vllm_config: Any) -> None:
    """vLLM's runner with the plugin's worker, pool, attention backend and scheduler: eager, synchronous,
    every custom op on its torch path; a default policy this runner cannot serve yet is refused at start."""
    from vllm.config import CompilationMode, CUDAGraphMode

    refuse_unsupported(vllm_config, "vllm")
    model = vllm_config.model_config
    if model is not None and getattr(model, "is_moe", False):
        refusal = moe_refusal(list(getattr(model, "architectures", None) or []), model.quantization)
        if refusal is not None:
            raise UnsupportedConfigError(refusal)
    additional = vllm_config.additional_config or {}
    if "kv_policy" in additional:
        from vllm_kvpress_ext.vllm_plugin.native.support import (
            ModelFacts,
            model_facts,
            native_refusal,
            with_parallelism,
        )
        from vllm_kvpress_ext.vllm_plugin.request_policy import default_policy

        check_policy_spec(additional["kv_policy"])
        facts = with_parallelism(model_facts(str(model.model)), vllm_config) if model is not None else ModelFacts()
        refusal = native_refusal(default_policy(additional), facts)
        if refusal is not None:
            raise UnsupportedConfigError(refusal)
    check_prefix_caching_settings(dict(additional))
    from vllm_kvpress_ext.policies.base import PolicyConfigError
    from vllm_kvpress_ext.vllm_plugin.chat_context import context_policy_setting

    try:
        context_policy_setting(dict(additional))
    except PolicyConfigError as exc:
        raise UnsupportedConfigError(f"additional_config kv_context_policy: {exc}") from None
    vllm_config.parallel_config.worker_cls = NATIVE_WORKER_CLS
    # vLLM's scheduler, starting and preempting by the pool's reports (as on the plugin's own runner), which
    # must be the last step's: scheduling is synchronous.
    vllm_config.scheduler_config.scheduler_cls = SCHEDULER_CLS
    vllm_config.scheduler_config.async_scheduling = False
    # vLLM's own prefix caching, on by default as in vLLM: the pool keeps the full blocks of uncompressed rows
    # under vLLM's block ids, and the scheduler caps vLLM's hits at them (native/prefix_blocks.py).
    if additional.get(PREFIX_CACHING_KEY):
        logger.info(
            "vllm-kvpress-ext: kv_runner 'vllm' reuses cached prefixes exactly (vLLM's prefix caching over the "
            "pool's uncompressed blocks), and compressed contexts that requests name (kv_prefix_tokens)"
        )
    compilation = vllm_config.compilation_config
    compilation.mode = CompilationMode.NONE
    compilation.cudagraph_mode = CUDAGraphMode.NONE
    compilation.cudagraph_capture_sizes = []
    compilation.custom_ops = ["none"]  # vLLM's ops run their torch paths: no vllm._C here


def apply_kvpress_config(vllm_config: Any) -> None:
    """Swap worker and scheduler, make scheduling synchronous and eager, force prefix caching off."""
    from vllm.config import CompilationMode, CUDAGraphMode

    if settle_runner(vllm_config) == "vllm":
        apply_native_config(vllm_config)
        return
    additional = vllm_config.additional_config
    refuse_unsupported(vllm_config)
    if "kv_policy" in additional:
        check_policy_spec(additional["kv_policy"])
    vllm_config.parallel_config.worker_cls = WORKER_CLS
    scheduler = vllm_config.scheduler_config
    scheduler.scheduler_cls = SCHEDULER_CLS
    # The scheduler budgets the pool from the worker's report of the step before; an asynchronous
    # schedule would budget from a report one step stale.
    scheduler.async_scheduling = False
    compilation = vllm_config.compilation_config
    compilation.mode = CompilationMode.NONE
    compilation.cudagraph_mode = CUDAGraphMode.NONE
    compilation.cudagraph_capture_sizes = []
    cache = vllm_config.cache_config
    mode = prefix_matching_mode(additional)
    if mode == "auto":
        logger.info(
            "vllm-kvpress-ext: prefix caching by the plugin's compressed prefix store (a request attaches to the "
            "longest stored prefix of its prompt, each finished request's cache stays for the next turn; "
            "vLLM's own block hashing stays off)"
        )
    elif mode == "named":
        logger.info(
            "vllm-kvpress-ext: prefix caching by the plugin's prefix store: a finished uncompressed request's cache "
            "serves later uncompressed prompts that start with the same tokens, exactly; compressed caches are not "
            "reused unless --enable-prefix-caching is given (vLLM's own block hashing stays off: a compressed "
            "per-head cache no longer holds every prompt token)"
        )
    cache.enable_prefix_caching = False
