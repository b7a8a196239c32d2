"""The attention backend vLLM's model layers call on this platform: the project's page pool, its kernels.

vLLM's `Attention` layer hands the backend each layer's new keys and values (`do_kv_cache_update`)
and then the layer's queries (`forward`). The cache is not vLLM's: every layer reads and writes the
project's per-(layer, KV head) page pool (`native/pool.py`), and vLLM's block tables and slot mapping
go unused (vLLM's runner binds an empty tensor as each layer's `kv_cache`). The metadata builder asks
the pool for the step's plan: the slot of each new token in every (layer, KV head), in the batch order
of vLLM's runner.

`forward` attends from each request's new queries to what its row holds, by the entries' stored
positions (query at position p sees entries at positions <= p), so compressed, ragged heads need nothing
else:

- a batch of decodes is one call of the project's paged decode kernel (`attention.paged_decode_attention`:
  the C++ kernel or torch on a CPU, Triton on CUDA);
- a prompt's first chunk is causal attention over its own keys (`attention.causal_attention`), a later
  chunk the paged prefill attention over the row (`attention.paged_prefill_attention`);
- a write-gated request (WG-KV) gates each chunk's keys (before RoPE, read off the QKV projection:
  `StepPlan.keys_pre_rope`) and attends under the vertical-slash mask (`attention.gated_chunk_attention`);
  its decodes read its local ring beside its global entries, and set each new ring entry's admission flag;
- a sliding-window layer (Gemma 2 and 3's local layers) holds a ring of exactly its window per (layer, KV
  head), token t at entry `t % w` (`PagedKVCache(layer_windows=...)`): a prompt chunk reads the ring before
  writing over it and attends within the window (`attention.ring_chunk_attention`, shared with the embedded engine);
  a decode's ring is exactly what its query sees, so the decode kernel reads it unmasked;
- a layer with a logit soft cap (Gemma 2), which the kernels do not take, runs torch's paths under the cap:
  decodes batched over rows and rings (`attention.paged_decode_attention(soft_cap=...)`), a write-gated
  chunk under the capped vertical-slash mask, and any other chunk over its row's entries gathered and masked
  by position (position q sees k when `k <= q`). GQA reads KV head `h // (num_heads / num_kv_heads)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from vllm_kvpress_ext.attention import (
    causal_attention,
    causal_attention_with_lse,
    gated_chunk_attention,
    gather_paged,
    paged_decode_attention,
    paged_prefill_attention,
    ring_chunk_attention,
)
from vllm_kvpress_ext.attention.reference import soft_capped
from vllm_kvpress_ext.engine.reconstruction import ReconstructionContext
from vllm_kvpress_ext.vllm_plugin.native.pool import NativePool, PrefillSpan, StepPlan


@dataclass
class KVPressAttentionMetadata(AttentionMetadata):
    """One step's batch, as the backend reads it: the pool's plan of the step; or, outside the steps, one chunk
    of KVzip's reconstruction pass over a request's row, which attends, scores and writes nothing."""

    plan: StepPlan
    reconstruction: ReconstructionContext | None = None


class KVPressAttentionMetadataBuilder(AttentionMetadataBuilder[KVPressAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Set by the runner once its pool exists (`native/runner.py`): the pool, and the runner's batch order.
        self.pool: NativePool | None = None
        self.batch_request_ids: Callable[[], list[str]] | None = None

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> KVPressAttentionMetadata:
        if self.pool is None or self.batch_request_ids is None:
            raise RuntimeError("the attention backend's builder was never given the pool")
        common = common_attn_metadata
        num_reqs = common.num_reqs
        plan = self.pool.plan(
            list(self.batch_request_ids()[:num_reqs]),
            common.query_start_loc_cpu[: num_reqs + 1].tolist(),
            common.seq_lens[:num_reqs].tolist(),
        )
        return KVPressAttentionMetadata(plan=plan)


class KVPressAttentionImpl(AttentionImpl[KVPressAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **unused: Any,
    ) -> None:
        refused = [
            name
            for name, present in (
                ("ALiBi slopes", alibi_slopes is not None),
                ("a quantized KV cache", kv_cache_dtype not in ("auto", "float16", "bfloat16", "float32")),
                (f"{attn_type} attention", attn_type != AttentionType.DECODER),
                ("KV sharing between layers", kv_sharing_target_layer_name is not None),
            )
            if present
        ]
        if refused:
            raise NotImplementedError(f"vllm-kvpress-ext's attention backend does not support {', '.join(refused)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not divide into {self.num_kv_heads} KV heads")
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # Set by the runner once its pool exists: the pool and this layer's index in it.
        self.pool: NativePool | None = None
        self.layer_index = -1

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write each new token's key and value at its slot in every KV head of this layer."""
        if self.pool is None:  # the profiling run, before the pool exists
            return
        plan = self.pool.current
        slots = plan.token_slots[self.layer_index]  # [T, Hkv]
        if self.sliding_window is not None:
            # A ring: a prompt chunk is written in `forward`, once the ring it overwrites has been read. A decode
            # token replaces the entry one window back, which its query no longer sees: written now. Tokens of
            # rows whose blocks are kept for prefix caching also go to those blocks' own pages.
            tokens = plan.decode_tokens.to(slots.device)
            self.pool.cache.write(slots[tokens], key[tokens], value[tokens])
            if plan.spill_slots is not None:
                spill = plan.spill_slots[self.layer_index]
                self.pool.cache.write(spill, key[: plan.num_tokens], value[: plan.num_tokens])
            return
        keys, values = key[: plan.num_tokens], value[: plan.num_tokens]
        if plan.written is not None:
            slots, keys, values = slots[plan.written], keys[plan.written], values[plan.written]
        self.pool.cache.write(slots, keys, values)
        for span in plan.prefills:  # a prompt compressed layer by layer: this layer's pages, allocated now
            layer_slots = span.layerwise.slots(self.layer_index) if span.layerwise is not None else None
            if layer_slots is not None:
                chunk = slice(span.begin, span.end)
                self.pool.cache.write(layer_slots.transpose(0, 1), key[chunk], value[chunk])

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KVPressAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None or self.pool is None:  # the profiling run, before the pool exists
            return output.fill_(0)
        plan = attn_metadata.plan
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        queries = query.view(query.shape[0], self.num_heads, self.head_size)
        key = key.view(key.shape[0], self.num_kv_heads, self.head_size)
        value = value.view(value.shape[0], self.num_kv_heads, self.head_size)
        if attn_metadata.reconstruction is not None:  # its context reads neither hidden states nor pre-RoPE keys
            out.copy_(attn_metadata.reconstruction.attend(self.layer_index, queries, queries, key, value, key))
            return output
        for begin, end in plan.failed_tokens:
            out[begin:end] = 0
        if self.sliding_window is not None:
            self._ring(plan, queries, key, value, out)
            return output
        self._admit_decodes(plan, key)
        self._decode(plan, queries, out)
        if self.logits_soft_cap is not None:
            self._masked_prefills(plan, queries, key, value, out)
            return output
        cache, layer_index = self.pool.cache, self.layer_index
        for span in plan.prefills:
            chunk = slice(span.begin, span.end)
            if span.layerwise is not None and span.layerwise.error is not None:
                # The request failed its layer-wise prefill (it fails after the pass) and this layer holds no
                # chunk: an output over the chunk's own keys only keeps the batch's pass going.
                out[chunk] = causal_attention(queries[chunk][None], key[chunk][None], value[chunk][None], self.scale)[0]
                continue
            want_lse = span.capture is not None and span.capture.spec.query_lse
            lse: torch.Tensor | None = None
            gated = self._gated(span, plan, queries[chunk], key[chunk], value[chunk])
            if gated is not None:
                attended = gated
            elif span.first_position == 0 and want_lse:
                attended, lse = causal_attention_with_lse(
                    queries[chunk][None], key[chunk][None], value[chunk][None], self.scale
                )
                attended, lse = attended[0], None if lse is None else lse[0]
            elif span.first_position == 0:
                attended = causal_attention(queries[chunk][None], key[chunk][None], value[chunk][None], self.scale)[0]
            else:
                lse_out: list[torch.Tensor] | None = [] if want_lse else None
                attended = paged_prefill_attention(
                    queries[chunk],
                    plan.query_positions[chunk].to(query.device),
                    cache.pool.kv,
                    cache.pool.positions,
                    cache.device_block_tables[layer_index, span.row],
                    cache.device_seq_lens[layer_index, span.row],
                    self.scale,
                    lse_out=lse_out,
                )
                lse = lse_out[0] if lse_out else None
            out[chunk] = attended.to(out.dtype)
            self._record(span, plan, queries[chunk], lse)
            if span.layerwise is not None:
                span.layerwise.compress(self.layer_index)
        return output

    def _decode(self, plan: StepPlan, queries: torch.Tensor, out: torch.Tensor, rings: bool = True) -> None:
        """The step's decodes, batched, over their rows (the project's paged decode kernel), local rings included
        unless `rings` is False (a sliding-window layer, whose own ring holds its window)."""
        if not plan.decode_tokens.numel():
            return
        assert self.pool is not None
        cache, layer_index = self.pool.cache, self.layer_index
        tokens = plan.decode_tokens.to(queries.device)
        out[tokens] = paged_decode_attention(
            queries[tokens],
            cache.pool.kv,
            cache.pool.positions,
            cache.device_block_tables[layer_index],
            cache.device_seq_lens[layer_index],
            plan.decode_rows,
            self.scale,
            cache.rings.device_tables[layer_index] if plan.rings and rings else None,
            cache.rings.lens().to(cache.device) if plan.rings and rings else None,
            probs_out=plan.decode_probs,
            soft_cap=self.logits_soft_cap,
        ).to(out.dtype)

    def _keys_pre_rope(self, plan: StepPlan) -> torch.Tensor:
        keys = plan.keys_pre_rope[self.layer_index] if plan.keys_pre_rope is not None else None
        if keys is None:
            raise RuntimeError("a write gate needs the keys before RoPE; this layer's QKV projection reported none")
        return keys

    def _admit_decodes(self, plan: StepPlan, keys: torch.Tensor) -> None:
        """Write-gated decodes (WG-KV): the flags of each new ring entry, from its key before and after RoPE, so
        that the ring promotes it to the global region when it is overwritten only if admitted."""
        if not plan.decode_gates:
            return
        assert self.pool is not None
        keys_pre_rope = self._keys_pre_rope(plan)
        for tokens, rows, gate in plan.decode_gates:
            index = tokens.to(keys.device)
            flags = gate.flags(self.layer_index, keys_pre_rope[index], keys[index])
            self.pool.cache.rings.admit(self.layer_index, rows, flags)

    def _gated(
        self, span: PrefillSpan, plan: StepPlan, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor | None:
        """A write-gated prompt chunk (WG-KV): its flags recorded, its attention under the vertical-slash mask
        (`attention.gated_chunk_attention`, as the embedded engine); None without a gate or where the mask is
        causal anyway."""
        if span.admission is None:
            return None
        assert self.pool is not None
        cache = self.pool.cache
        admitted = span.admission.gate(self.layer_index, self._keys_pre_rope(plan)[span.begin : span.end], keys)
        return gated_chunk_attention(
            cache.pool.kv,
            cache.pool.positions,
            cache.device_block_tables[self.layer_index, span.row],
            cache.device_seq_lens[self.layer_index, span.row],
            queries,
            keys,
            values,
            admitted,
            span.admission.window,
            self.scale,
            span.first_position,
            soft_cap=self.logits_soft_cap,
        )

    def _ring(
        self, plan: StepPlan, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor
    ) -> None:
        """A sliding-window layer, whose rows are rings of `window` entries (token t at entry t % window).

        A prompt chunk attends over the ring and itself within the window (`attention.ring_chunk_attention`, as
        the embedded engine does), then writes itself into the ring. A decode's ring holds exactly the window
        its query sees, so decodes need no mask (`_decode`). No policy compresses these layers, so nothing of them
        is captured.
        """
        assert self.pool is not None and self.sliding_window is not None
        cache = self.pool.cache
        for span in plan.prefills:
            chunk = slice(span.begin, span.end)
            out[chunk] = ring_chunk_attention(
                cache.pool.kv,
                cache.pool.positions,
                cache.device_block_tables[self.layer_index, span.row],
                span.first_position,
                queries[chunk],
                plan.query_positions[chunk].to(queries.device),
                keys[chunk],
                values[chunk],
                self.sliding_window,
                self.scale,
                soft_cap=self.logits_soft_cap,
            ).to(out.dtype)
            cache.write(plan.token_slots[self.layer_index, chunk], keys[chunk], values[chunk])  # after the ring's read
        self._decode(plan, queries, out, rings=False)

    def _record(self, span: PrefillSpan, plan: StepPlan, queries: torch.Tensor, lse: torch.Tensor | None) -> None:
        """What the request's policy captures of this chunk in this layer (the window's queries, after RoPE)."""
        if span.capture is not None:
            positions = plan.query_positions[span.begin : span.end].to(queries.device)
            span.capture.record(self.layer_index, positions, None, queries, None, None, lse)

    def _masked_prefills(
        self, plan: StepPlan, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Prompt chunks in a layer with a logit soft cap (Gemma 2), which the prefill kernels do not apply: a
        write-gated chunk under the vertical-slash mask (`_gated`, capped), else each chunk over its row's entries,
        masked by position, in torch."""
        assert self.pool is not None
        cache, layer_index = self.pool.cache, self.layer_index
        group = self.num_heads // self.num_kv_heads
        for span in plan.prefills:
            chunk = slice(span.begin, span.end)
            gated = self._gated(span, plan, queries[chunk], keys[chunk], values[chunk])
            if gated is not None:
                out[chunk] = gated.to(out.dtype)
            else:
                held_keys, held_values, positions, valid = gather_paged(
                    cache.pool.kv,
                    cache.pool.positions,
                    cache.device_block_tables[layer_index, span.row],
                    cache.device_seq_lens[layer_index, span.row],
                )  # [Hkv, N, d], positions and validity [Hkv, N]
                query_positions = plan.query_positions[chunk].to(positions.device).view(1, -1, 1)
                mask = valid.unsqueeze(1) & (positions.to(torch.int64).unsqueeze(1) <= query_positions)  # [Hkv, n, N]
                chunk_queries = queries[chunk].transpose(0, 1)  # [Hq, n, d]
                held_keys = held_keys.to(chunk_queries.dtype).repeat_interleave(group, 0)
                held_values = held_values.to(chunk_queries.dtype).repeat_interleave(group, 0)
                logits = torch.matmul(chunk_queries, held_keys.transpose(-1, -2)).float() * self.scale
                weights = soft_capped(logits, self.logits_soft_cap)
                weights = weights.masked_fill(~mask.repeat_interleave(group, 0), float("-inf")).softmax(-1)
                out[chunk] = torch.matmul(weights.to(held_values.dtype), held_values).transpose(0, 1).to(out.dtype)
            self._record(span, plan, queries[chunk], None)
            if span.layerwise is not None:
                span.layerwise.compress(self.layer_index)


class KVPressAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16", "float32"]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[KVPressAttentionImpl]:
        return KVPressAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVPressAttentionMetadataBuilder]:
        return KVPressAttentionMetadataBuilder

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[Any, ...]:
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return (KVCacheLayout.LBNHC,)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]
