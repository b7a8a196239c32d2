"""`KVPressModelRunner`: vLLM's `CPUModelRunner` whose KV cache is the project's per-(layer, KV head) pool.

vLLM's runner sizes and allocates one tensor per layer in its own block layout
(`initialize_kv_cache_tensors`). This runner allocates the project's page pool instead, once for all
layers, and binds an empty tensor where each layer expects its cache: the attention backend never
reads vLLM's blocks. Everything else about the KV cache stays vLLM's: its KV cache groups (full and
sliding-window layers alike), its block manager and block tables. Those still plan every request's
blocks, so the worker gives vLLM's planner room for as many blocks as its scheduler could ask for
(`bookkeeping_bytes`), none of it allocated; the real limit is the pool, which `KVPressScheduler`
applies from the pool's reports.

Pool size: `additional_config["kv_num_pages"]`, else `--kv-cache-memory-bytes`, else the embedded
engine's default (1 GiB). Pages hold `--block-size` tokens of one (layer, KV head).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, cast

import torch
from vllm.forward_context import set_forward_context
from vllm.model_executor.models.utils import extract_layer_index
from vllm.sequence import IntermediateTensors
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.utils import bind_kv_cache

from vllm_kvpress_ext.cache import PagedKVCache
from vllm_kvpress_ext.cache.pool import DEFAULT_KV_MEMORY, PagePool
from vllm_kvpress_ext.engine.compression import relay_failing_alike
from vllm_kvpress_ext.engine.prefix_store import PrefixStore
from vllm_kvpress_ext.engine.reconstruction import ReconstructionContext
from vllm_kvpress_ext.policies.base import AdmissionPolicy
from vllm_kvpress_ext.vllm_plugin.config import MAX_CACHED_PREFIXES_KEY
from vllm_kvpress_ext.vllm_plugin.contexts import contexts_kept
from vllm_kvpress_ext.vllm_plugin.gguf_model import gguf_source
from vllm_kvpress_ext.vllm_plugin.native.attention import (
    KVPressAttentionImpl,
    KVPressAttentionMetadata,
    KVPressAttentionMetadataBuilder,
)
from vllm_kvpress_ext.vllm_plugin.native.pool import NativePool
from vllm_kvpress_ext.vllm_plugin.native.support import layer_projections, native_rope
from vllm_kvpress_ext.vllm_plugin.native.tensor_parallel import head_shard, relay_stages
from vllm_kvpress_ext.vllm_plugin.request_policy import default_policy

logger = logging.getLogger("vllm.kvpress.runner")


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """`x` as `[T, features]`, whatever batch dimensions lead."""
    return x.reshape(-1, x.shape[-1])


class KVPressModelRunner(CPUModelRunner):
    pool: NativePool | None = None

    def initialize_kv_cache_tensors(
        self,
        kv_cache_config: Any,
        kernel_block_sizes: list[int],
        kv_cache_allocation_context: AbstractContextManager[Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        context = self.compilation_config.static_forward_context
        names = sorted(
            {name for group in kv_cache_config.kv_cache_groups for name in group.layer_names},
            key=extract_layer_index,
        )
        layers = [context[name] for name in names]
        shapes = {(layer.num_kv_heads, layer.head_size) for layer in layers}
        if len(shapes) != 1:
            raise NotImplementedError(
                f"vllm-kvpress-ext's pool holds one KV head count and head size for every layer; this model has "
                f"{sorted(shapes)}"
            )
        for name, layer in zip(names, layers, strict=True):
            if not isinstance(layer.impl, KVPressAttentionImpl):
                raise NotImplementedError(f"layer {name} does not run the plugin's attention backend")
        ((num_kv_heads, head_size),) = shapes
        dtype = self.kv_cache_dtype
        page_size = self.cache_config.block_size
        windows = [layer.impl.sliding_window for layer in layers]
        additional: dict[str, Any] = dict(cast(dict[str, Any], self.vllm_config.additional_config or {}))
        prefix_caching = bool(self.cache_config.enable_prefix_caching)
        # Stored named contexts hold rows of their own (vllm_plugin/contexts.py): at least one more than the requests
        # that may run at once, so that a new context always has a place, whichever contexts those requests read.
        max_num_seqs = self.scheduler_config.max_num_seqs
        stored_contexts = (
            max(int(additional.get(MAX_CACHED_PREFIXES_KEY, 16)), max_num_seqs + 1)
            if contexts_kept(self.vllm_config, "vllm")
            else 0
        )
        cache = PagedKVCache(
            len(layers),
            num_kv_heads,
            head_size,
            num_pages=self._pool_pages(page_size, head_size, dtype),
            page_size=page_size,
            max_requests=max_num_seqs + stored_contexts,
            dtype=dtype,
            device=self.device,
            layer_windows=windows,  # a sliding-window layer is a ring of its window
        )
        impl = layers[0].impl
        rotary = native_rope(self.model_config.model)
        contexts = PrefixStore(cache, str(self.model_config.model), stored_contexts) if stored_contexts else None
        pool = NativePool(
            cache,
            impl.num_heads,
            impl.scale,
            default_policy(additional),
            rotary,
            prefix_caching=prefix_caching,
            contexts=contexts,
            shard=head_shard(
                self.parallel_config.tensor_parallel_size, num_kv_heads, self.model_config.get_total_num_kv_heads()
            ),
        )
        self.pool = pool
        model_layers = [extract_layer_index(name) for name in names]
        pool.pipeline_stages = int(self.parallel_config.pipeline_parallel_size)
        if pool.pipeline_stages > 1:
            pool.stage = (model_layers[0], int(self.model_config.get_total_num_hidden_layers()))
        self._hook_projections(pool, model_layers)
        pool.reconstruction_forward = self._reconstruction_forward
        pool.tokenizer_dir = str(self.model_config.tokenizer or self.model_config.model)
        # Where WG-KV looks for the model's write gates: beside the model, or a GGUF file's shipped ones.
        pool.model_path = gguf_source(self.model_config.model) or Path(self.model_config.model)
        pool.max_model_len = int(self.model_config.max_model_len)
        pool.soft_caps = [layer.impl.logits_soft_cap for layer in layers]
        if isinstance(pool.default_policy, AdmissionPolicy):
            # A default write gate that cannot run here (no gates for this model, gates of another) would fail every
            # request: `vllm serve` stops at start with the reason.
            pool.bind_gate(pool.default_policy, 1, None)
        self._attention_layer_names = names
        pages = cache.pool.num_pages
        logger.info(
            "vllm-kvpress-ext: the KV cache is the plugin's pool: %d pages of %d tokens per (layer, KV head), "
            "%.1f MiB, %d tokens of one uncompressed request%s (vLLM's block figures above are bookkeeping only)",
            pages,
            page_size,
            pages * cache.pool.bytes_per_page / 2**20,
            pages // (len(layers) * num_kv_heads) * page_size,
            " in every layer; sliding-window layers are rings of their window" if any(windows) else "",
        )
        for index, layer in enumerate(layers):
            layer.impl.pool = pool
            layer.impl.layer_index = index
        for groups in self.attn_groups:
            for group in groups:
                for builder in group.metadata_builders:
                    if isinstance(builder, KVPressAttentionMetadataBuilder):
                        builder.pool = pool
                        builder.batch_request_ids = self._batch_request_ids
        placeholders = {name: torch.empty(0, dtype=dtype, device=self.device) for name in names}
        bind_kv_cache(placeholders, context, self.kv_caches, kv_cache_groups=kv_cache_config.kv_cache_groups)
        return placeholders

    def _hook_projections(self, pool: NativePool, model_layers: list[int]) -> None:
        """Where the model is laid out as vLLM's Llama family and the project knows its RoPE: each layer's QKV
        projection reports its input (the normed hidden states) and its output (whose keys, before RoPE, the
        write gates read) to the pool, and its query rows serve policies that project synthetic hidden states
        (GVote)."""
        projections = layer_projections(self.model, model_layers) if pool.rotary is not None else None
        if projections is None:
            return
        for layer, projection in enumerate(projections):
            # `[T, ...]` as the pool reads them: vLLM's Transformers backend runs HF's modules, with a batch of one.
            projection.module.register_forward_pre_hook(
                lambda _module, args, layer=layer: pool.record_hidden(layer, _tokens(args[0]))
            )
            projection.module.register_forward_hook(
                lambda _module, _args, output, layer=layer, split=projection.keys: pool.record_keys(
                    layer, _tokens(output[0] if isinstance(output, tuple) else output), split
                )
            )
        pool.query_projections = [projection.queries for projection in projections]

    def _reconstruction_forward(self, context: ReconstructionContext, ids: list[int], positions: torch.Tensor) -> None:
        """One chunk of KVzip's reconstruction pass through vLLM's model: every layer's attention is the context's
        (it reads the request's row, scores it and writes nothing; no slot mapping, so no cache write).

        Under pipeline parallelism each stage runs its layers in turn, from the hidden states the stage before
        relays (`relay_stages`), and scores its layers' part of the row; every stage compresses the same request
        at the same step, so they run the same chunks in the same order. A stage whose forward raises relays the
        failure instead, and every stage raises it for this chunk."""
        assert self.pool is not None
        metadata = KVPressAttentionMetadata(plan=self.pool.current, reconstruction=context)
        layers = dict.fromkeys(self._attention_layer_names, metadata)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        positions = positions.to(self.device)

        def forward(received: IntermediateTensors | None) -> Any:
            # A later stage's layers start from the hidden states it received (vLLM's models take them so).
            extra = {} if received is None else {"intermediate_tensors": received}
            with set_forward_context(layers, self.vllm_config, num_tokens=len(ids)):
                return self.model(input_ids=input_ids, positions=positions, **extra)

        if self.pool.pipeline_stages == 1:
            forward(None)
            return

        def stage(carried: Any) -> Any:
            received = None
            if carried is not None:
                received = IntermediateTensors({name: t.to(self.device) for name, t in carried.items()})
            output = forward(received)
            if isinstance(output, IntermediateTensors):  # the next stage continues from these
                return {name: tensor.cpu() for name, tensor in output.tensors.items()}
            return None

        relay_failing_alike(relay_stages, stage, "the reconstruction pass")

    def _batch_request_ids(self) -> list[str]:
        return self.input_batch.req_ids  # read at each build: the runner may replace its input batch

    def _pool_pages(self, page_size: int, head_size: int, dtype: torch.dtype) -> int:
        additional = cast(dict[str, Any], self.vllm_config.additional_config or {})
        if "kv_num_pages" in additional:
            return int(additional["kv_num_pages"])
        memory = self.cache_config.kv_cache_memory_bytes or DEFAULT_KV_MEMORY
        return PagePool.pages_for_memory(int(memory), page_size, head_size, dtype)

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        """vLLM zeroes fresh blocks of its own cache; there is none here (pool pages are written before read)."""
