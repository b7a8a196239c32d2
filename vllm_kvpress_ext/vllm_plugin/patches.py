"""Every vLLM internal the plugin patches, named in one place, with the parameters the pinned vLLM gives it.

The plugin runs inside vLLM through interfaces vLLM does not promise to keep (RFC #57566 asks for a
stable contract; until then these shift between minor releases). `PATCHES` lists each one and how the
plugin depends on it:

- `OVERRIDDEN`: a plugin class subclasses a vLLM class and redefines this method or attribute
  (the scheduler, the workers, the platform, the attention backend, the model runner);
- `WRAPPED`: the plugin replaces it by a function that calls the original (`wrap` below);
- `REPLACED`: the plugin replaces it outright (`wrap` as well, with a function that ignores the original);
- `PROXIED`: a plugin object stands in front of a vLLM object and redefines this method of it
  (`_PoolGate` in front of the scheduler's `KVCacheManager`).

Each entry records the parameter list (names, `=` for a default, `*`/`**` markers) the pinned vLLM's
definition has, so a new release is checked against this list, not found by failures:
`tools/vllm_release_check.py` prints `drift()` for the release it installs (missing targets, changed
parameters), and `tests/test_vllm_patches.py` holds the list to the installed vLLM and to the code:
every override a plugin class makes and every patch site (`wrap` is the only one; the test scans the
plugin's source for attribute assignments on vLLM objects and `setattr`) is listed here.

What the plugin only *calls* (`kv_cache_manager.truncate_computed_blocks`, a request's
`prefill_stats`, ...) is not listed: the release check imports every vLLM name the plugin imports, and
the plugin's tests call the rest.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OVERRIDDEN = "overridden"
WRAPPED = "wrapped"
REPLACED = "replaced"
PROXIED = "proxied"


@dataclass(frozen=True)
class Patch:
    target: str  # "module:Qualified.name", where the pinned vLLM defines it
    how: str  # OVERRIDDEN, WRAPPED, REPLACED or PROXIED
    where: str  # the plugin module that does it, under vllm_kvpress_ext.vllm_plugin
    params: str | None  # its parameters on the pinned vLLM (`parameters`); None: not a function


PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.v1.core.sched.scheduler:Scheduler.__init__",
        OVERRIDDEN,
        "scheduler",
        "self, vllm_config, kv_cache_config, structured_output_manager, block_size, hash_block_size=, mm_registry=,"
        " include_finished_set=, log_stats=",
    ),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.schedule", OVERRIDDEN, "scheduler", "self, throttle_prefills="),
    Patch("vllm.v1.core.sched.scheduler:Scheduler.get_num_unfinished_requests", OVERRIDDEN, "scheduler", "self"),
    Patch(
        "vllm.v1.core.sched.scheduler:Scheduler._preempt_request",
        OVERRIDDEN,
        "scheduler",
        "self, request, timestamp, drop_stale_output=",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler:Scheduler.finish_requests",
        OVERRIDDEN,
        "scheduler",
        "self, request_ids, finished_status",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
        OVERRIDDEN,
        "scheduler",
        "self, scheduler_output, model_runner_output",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler:Scheduler._free_request",
        OVERRIDDEN,
        "scheduler",
        "self, request, delay_free_blocks=",
    ),
    Patch(
        "vllm.v1.worker.worker_base:WorkerBase.__init__",
        OVERRIDDEN,
        "worker",
        "self, vllm_config, local_rank, rank, distributed_init_method, is_driver_worker=",
    ),
    Patch("vllm.v1.worker.worker_base:WorkerBase.init_device", OVERRIDDEN, "worker", "self"),
    Patch("vllm.v1.worker.worker_base:WorkerBase.load_model", OVERRIDDEN, "worker", "self, *, load_dummy_weights="),
    Patch("vllm.v1.worker.worker_base:WorkerBase.get_kv_cache_spec", OVERRIDDEN, "worker", "self"),
    Patch("vllm.v1.worker.worker_base:WorkerBase.get_supported_kv_cache_layouts", OVERRIDDEN, "worker", "self"),
    Patch("vllm.v1.worker.worker_base:WorkerBase.compile_or_warm_up_model", OVERRIDDEN, "worker", "self"),
    Patch("vllm.v1.worker.worker_base:WorkerBase.get_model", OVERRIDDEN, "worker", "self"),
    Patch("vllm.v1.worker.worker_base:WorkerBase.get_cache_block_size_bytes", OVERRIDDEN, "worker", "self"),
    Patch("vllm.v1.worker.worker_base:WorkerBase.check_health", OVERRIDDEN, "worker", "self"),
    Patch("vllm.v1.worker.worker_base:WorkerBase.shutdown", OVERRIDDEN, "worker", "self"),
    Patch("vllm.v1.worker.worker_base:WorkerBase.execute_model", OVERRIDDEN, "worker", "self, scheduler_output"),
    Patch("vllm.platforms.interface:Platform.dispatch_key", OVERRIDDEN, "platform", None),
    Patch("vllm.platforms.interface:Platform.dist_backend", OVERRIDDEN, "platform", None),
    Patch("vllm.platforms.interface:Platform.ray_device_key", OVERRIDDEN, "platform", None),
    Patch("vllm.platforms.interface:Platform.supported_dtypes", OVERRIDDEN, "platform", "self"),
    Patch("vllm.platforms.interface:Platform.get_device_name", OVERRIDDEN, "platform", "cls, device_id="),
    Patch("vllm.platforms.interface:Platform.get_device_total_memory", OVERRIDDEN, "platform", "cls, device_id="),
    Patch("vllm.platforms.interface:Platform.is_pin_memory_available", OVERRIDDEN, "platform", "cls"),
    Patch("vllm.platforms.interface:Platform.inference_mode", OVERRIDDEN, "platform", "cls"),
    Patch("vllm.platforms.interface:Platform.import_kernels", OVERRIDDEN, "platform", "cls"),
    Patch("vllm.platforms.interface:Platform.set_device", OVERRIDDEN, "platform", "cls, device"),
    Patch("vllm.platforms.interface:Platform.check_and_update_config", OVERRIDDEN, "platform", "cls, vllm_config"),
    Patch(
        "vllm.platforms.interface:Platform.validate_request", OVERRIDDEN, "platform", "cls, processed_inputs, params"
    ),
    Patch(
        "vllm.platforms.interface:Platform.get_attn_backend_cls",
        OVERRIDDEN,
        "platform",
        "cls, selected_backend, attn_selector_config, num_heads=",
    ),
    Patch("vllm.platforms.interface:Platform.manual_seed_all", OVERRIDDEN, "platform", "cls, seed"),
    Patch("vllm.v1.worker.gpu_worker:Worker.init_device", OVERRIDDEN, "native.worker", "self"),
    Patch("vllm.v1.worker.gpu_worker:Worker.load_model", OVERRIDDEN, "native.worker", "self, *, load_dummy_weights="),
    Patch("vllm.v1.worker.gpu_worker:Worker.determine_available_memory", OVERRIDDEN, "native.worker", "self"),
    Patch("vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model", OVERRIDDEN, "native.worker", "self"),
    Patch("vllm.v1.worker.gpu_worker:Worker.execute_model", OVERRIDDEN, "native.worker", "self, scheduler_output"),
    Patch("vllm.v1.worker.gpu_worker:Worker.sample_tokens", OVERRIDDEN, "native.worker", "self, grammar_output"),
    Patch(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.initialize_kv_cache_tensors",
        OVERRIDDEN,
        "native.runner",
        "self, kv_cache_config, kernel_block_sizes, kv_cache_allocation_context=",
    ),
    Patch(
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner._zero_block_ids", OVERRIDDEN, "native.runner", "self, block_ids"
    ),
    Patch(
        "vllm.v1.attention.backend:AttentionMetadataBuilder._cudagraph_support", OVERRIDDEN, "native.attention", None
    ),
    Patch(
        "vllm.v1.attention.backend:AttentionMetadataBuilder.__init__",
        OVERRIDDEN,
        "native.attention",
        "self, kv_cache_spec, layer_names, vllm_config, device",
    ),
    Patch(
        "vllm.v1.attention.backend:AttentionMetadataBuilder.build",
        OVERRIDDEN,
        "native.attention",
        "self, common_prefix_len, common_attn_metadata, fast_build=",
    ),
    Patch(
        "vllm.v1.attention.backend:AttentionImpl.__init__",
        OVERRIDDEN,
        "native.attention",
        "self, num_heads, head_size, scale, num_kv_heads=, alibi_slopes=, sliding_window=, kv_cache_dtype=,"
        " logits_soft_cap=, attn_type=, kv_sharing_target_layer_name=",
    ),
    Patch(
        "vllm.v1.attention.backend:AttentionImpl.forward",
        OVERRIDDEN,
        "native.attention",
        "self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=, output_block_scale=",
    ),
    Patch("vllm.v1.attention.backend:AttentionBackend.supported_dtypes", OVERRIDDEN, "native.attention", None),
    Patch("vllm.v1.attention.backend:AttentionBackend.supported_kv_cache_dtypes", OVERRIDDEN, "native.attention", None),
    Patch(
        "vllm.v1.attention.backend:AttentionBackend.forward_includes_kv_cache_update",
        OVERRIDDEN,
        "native.attention",
        None,
    ),
    Patch("vllm.v1.attention.backend:AttentionBackend.get_name", OVERRIDDEN, "native.attention", ""),
    Patch("vllm.v1.attention.backend:AttentionBackend.get_impl_cls", OVERRIDDEN, "native.attention", ""),
    Patch("vllm.v1.attention.backend:AttentionBackend.get_builder_cls", OVERRIDDEN, "native.attention", ""),
    Patch("vllm.v1.attention.backend:AttentionBackend.supports_sliding_window", OVERRIDDEN, "native.attention", "cls"),
    Patch(
        "vllm.v1.attention.backend:AttentionBackend.supported_kv_cache_layouts", OVERRIDDEN, "native.attention", "cls"
    ),
    Patch(
        "vllm.v1.attention.backend:AttentionBackend.get_supported_kernel_block_sizes",
        OVERRIDDEN,
        "native.attention",
        "kv_cache_spec=",
    ),
    # The CUDA platform (vllm_plugin/cuda_platform.py) subclasses whichever base vLLM chose at import; vLLM's
    # CUDA module does not import without a CUDA driver, so these two are checked only where one is.
    Patch(
        "vllm.platforms.cuda:CudaPlatformBase.check_and_update_config", OVERRIDDEN, "cuda_platform", "cls, vllm_config"
    ),
    Patch(
        "vllm.platforms.interface:Platform.validate_request",
        OVERRIDDEN,
        "cuda_platform",
        "cls, processed_inputs, params",
    ),
    Patch("vllm.engine.arg_utils:EngineArgs.add_cli_args", WRAPPED, "cli_args", "parser"),
    Patch("vllm.engine.arg_utils:EngineArgs.from_cli_args", WRAPPED, "cli_args", "cls, args"),
    Patch(
        "vllm.engine.arg_utils:EngineArgs.create_engine_config", WRAPPED, "cli_args", "self, usage_context=, headless="
    ),
    Patch(
        "vllm.engine.arg_utils:EngineArgs.create_engine_config",
        WRAPPED,
        "gguf_model",
        "self, usage_context=, headless=",
    ),
    Patch("vllm.engine.arg_utils:get_model_path", WRAPPED, "gguf_model", "model, revision="),
    Patch(
        "vllm.v1.engine.output_processor:RequestState.make_request_output",
        WRAPPED,
        "usage",
        "self, new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params=, ec_transfer_params=,"
        " error=",
    ),
    Patch(
        "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.request_output_to_completion_response",
        WRAPPED,
        "usage",
        "self, final_res_batch, request, request_id, created_time, model_name, tokenizer, request_metadata",
    ),
    Patch(
        "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.completion_stream_generator",
        WRAPPED,
        "usage",
        "self, request, engine_inputs, result_generator, request_id, created_time, model_name, num_prompts, tokenizer,"
        " request_metadata",
    ),
    Patch(
        "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_stream_generator",
        WRAPPED,
        "usage",
        "self, request, result_generator, request_id, model_name, conversation, tokenizer, request_metadata,"
        " chat_template_kwargs=, mm_token_counts=",
    ),
    Patch(
        "vllm.entrypoints.launchers.api_server.entry:build_app",
        WRAPPED,
        "middleware",
        "args, supported_tasks=, model_config=",
    ),
    Patch("vllm.model_executor.layers.linear:dispatch_unquantized_gemm", REPLACED, "native.adapter", "linear_backend="),
    Patch(
        "vllm.model_executor.layers.vocab_parallel_embedding:dispatch_unquantized_gemm",
        REPLACED,
        "native.adapter",
        "linear_backend=",
    ),
    Patch(
        "vllm.v1.worker.block_table:_COMPUTE_SLOT_MAPPING_KERNEL",
        WRAPPED,
        "native.adapter",
        "num_reqs, num_tokens, max_num_tokens, query_start_loc, positions, block_table, block_table_stride,"
        " slot_mapping, kv_cache_block_size, total_cp_world_size, total_cp_rank, cp_kv_cache_interleave_size",
    ),
    Patch("vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context", REPLACED, "native.adapter", "self, tag"),
    Patch(
        "vllm.model_executor.layers.fused_moe.router.fused_topk_router:FusedTopKRouter._compute_routing",
        WRAPPED,
        "native.moe",
        "self, hidden_states, router_logits, indices_type, *, input_ids=",
    ),
    Patch(
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.name",
        OVERRIDDEN,
        "native.moe",
        None,
    ),
    Patch(
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.forward_native",
        OVERRIDDEN,
        "native.moe",
        "self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input",
    ),
    Patch(
        "vllm.model_executor.custom_op:CustomOp.forward_oot",
        OVERRIDDEN,
        "native.moe",
        "self, *args, **kwargs",
    ),
    Patch(
        "vllm.model_executor.layers.fused_moe.fused_moe_method_base:FusedMoEMethodBase.is_monolithic",
        OVERRIDDEN,
        "native.moe",
        "self",
    ),
    Patch(
        "vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks",
        PROXIED,
        "scheduler",
        "self, request, max_cache_hit_length=",
    ),
    Patch(
        "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
        PROXIED,
        "scheduler",
        "self, request, num_new_tokens, num_new_computed_tokens=, new_computed_blocks=, num_lookahead_tokens=,"
        " num_external_computed_tokens=, delay_cache_blocks=, num_encoder_tokens=, full_sequence_must_fit=,"
        " reserved_blocks=, has_scheduled_reqs=, skip_zeroing_group_ids=",
    ),
)

# What `wrap` found before it replaced a target: the release check and the tests read vLLM's own definition
# through it, not the plugin's replacement.
_originals: dict[str, Any] = {}
_applied: set[tuple[str, str]] = set()


def target_of(owner: Any, name: str) -> str:
    """`module:Qualified.name` of `owner.name` (owner a module or a class)."""
    if inspect.ismodule(owner):
        return f"{owner.__name__}:{name}"
    return f"{owner.__module__}:{owner.__qualname__}.{name}"


def wrap(owner: Any, name: str, make: Callable[[Any], Any], where: str) -> None:
    """Set `owner.name` to `make(original)`, once per process for each (target, plugin module).

    `original` is the attribute as the class or module holds it (a staticmethod or classmethod object
    stays one). The target must be listed in `PATCHES` for `where` (the calling plugin module, e.g.
    "cli_args"), and vLLM must still have it: a release that moved it fails here, naming it."""
    target = target_of(owner, name)
    if not any(p.target == target and p.where == where and p.how in (WRAPPED, REPLACED) for p in PATCHES):
        raise RuntimeError(f"{target} is patched by vllm_plugin.{where} but not listed in vllm_plugin/patches.py")
    try:
        original = inspect.getattr_static(owner, name)
    except AttributeError:
        raise RuntimeError(
            f"this vLLM has no {target}, which vllm_plugin.{where} patches (vllm_plugin/patches.py lists what the"
            " plugin needs; docs/vllm.md says how a release is taken up)"
        ) from None
    if (target, where) in _applied:
        return
    _originals.setdefault(target, original)
    setattr(owner, name, make(original))
    _applied.add((target, where))


def resolve(target: str) -> Any:
    """vLLM's own definition of `target` (the one `wrap` replaced, if it did). Raises ImportError or
    AttributeError when this vLLM lacks it."""
    if target in _originals:
        return _originals[target]
    module_name, _, path = target.partition(":")
    found: Any = importlib.import_module(module_name)
    for part in path.split("."):
        found = inspect.getattr_static(found, part)
    return found


def parameters(found: Any) -> str | None:
    """`found`'s parameter names as `PATCHES` records them: "self, request, timeout=, *args, **kwargs"."""
    function = getattr(found, "__func__", found)  # staticmethod, classmethod
    if isinstance(function, property):
        function = function.fget
    if not callable(function) or isinstance(function, type):
        return None
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    names: list[str] = []
    starred = False
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.VAR_POSITIONAL:
            names.append(f"*{parameter.name}")
            starred = True
        elif parameter.kind is parameter.VAR_KEYWORD:
            names.append(f"**{parameter.name}")
        else:
            if parameter.kind is parameter.KEYWORD_ONLY and not starred:
                names.append("*")
                starred = True
            names.append(parameter.name + ("=" if parameter.default is not parameter.empty else ""))
    return ", ".join(names)


def drift(patches: tuple[Patch, ...] = PATCHES) -> list[str]:
    """One line for each listed internal that the installed vLLM no longer has, or has with other parameters."""
    lines: list[str] = []
    for patch in patches:
        label = f"{patch.target} ({patch.how} by vllm_plugin.{patch.where})"
        try:
            found = resolve(patch.target)
        except (ImportError, AttributeError, OSError) as error:
            lines.append(f"{label}: missing ({type(error).__name__}: {error})")
            continue
        now = parameters(found)
        if now != patch.params:
            lines.append(f"{label}: parameters were ({patch.params}), now ({now})")
    return lines
