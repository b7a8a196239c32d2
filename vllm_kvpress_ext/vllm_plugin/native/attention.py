"""The attention backend vLLM's model layers call on this platform (torch; no compiled vLLM ops).

vLLM's `Attention` layer hands the backend each layer's new keys and values (`do_kv_cache_update`,
written at the slots vLLM's scheduler assigned) and then the layer's queries (`forward`). The layer's
cache is vLLM's own block layout, `kv_cache[num_blocks, num_kv_heads, block_size, 2 * head_size]`
(keys in the first half of the last axis, values in the second), which is what the LBNHC layout gives
a backend that says `forward_includes_kv_cache_update = False`.

`forward` attends, for each request of the batch, from its new queries to its first `seq_len` cached
entries, in order: the queries sit at the last positions, so query i of n sees entries up to
`seq_len - n + i` (causal), and with a sliding window `w` only those within `w` positions, as HF
transformers' `sliding_window` (position q sees k when `q - k < w`). GQA reads KV head
`h // (num_heads / num_kv_heads)` (SDPA's `enable_gqa`). A batch of decodes (one query each) is one
`scaled_dot_product_attention` over the requests' entries gathered into a padded tensor (the cache's
slots of every request computed once per step, in the metadata); a batch with prefill chunks takes
one call per request. The page-reading kernels come with the project's pool behind this backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
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


@dataclass
class KVPressAttentionMetadata(AttentionMetadata):
    """One step's batch, as the backend reads it."""

    num_actual_tokens: int
    num_reqs: int
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]: cached entries of each request after this step's writes
    entry_slots: torch.Tensor  # [num_reqs, max seq_len]: the cache slot of each request's entry, in order
    entry_valid: torch.Tensor  # [num_reqs, max seq_len]: which of those are within the request's seq_len
    decode_only: bool  # one query per request: one batched attention call


class KVPressAttentionMetadataBuilder(AttentionMetadataBuilder[KVPressAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> KVPressAttentionMetadata:
        common = common_attn_metadata
        num_reqs = common.num_reqs
        seq_lens = common.seq_lens[:num_reqs].to(torch.int64)
        longest = int(seq_lens.max()) if num_reqs else 0
        block_size = self.kv_cache_spec.block_size
        tables = common.block_table_tensor[:num_reqs, : -(-longest // block_size)].to(torch.int64)
        offsets = torch.arange(block_size, device=tables.device)
        entry_slots = (tables.unsqueeze(-1) * block_size + offsets).reshape(num_reqs, -1)[:, :longest]
        entry_valid = torch.arange(longest, device=tables.device).unsqueeze(0) < seq_lens.unsqueeze(1)
        query_start_loc = common.query_start_loc_cpu[: num_reqs + 1].tolist()
        return KVPressAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=num_reqs,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens.tolist(),
            entry_slots=entry_slots.masked_fill(~entry_valid, 0),
            entry_valid=entry_valid,
            decode_only=common.num_actual_tokens == num_reqs,
        )


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

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write each new token's key and value at its slot (slots < 0 are padding)."""
        count = min(key.shape[0], slot_mapping.shape[0])
        slots = slot_mapping[:count].to(torch.int64)
        valid = slots >= 0
        entries = torch.cat([key[:count][valid], value[:count][valid]], dim=-1)  # [n, Hkv, 2d]
        _by_slot(kv_cache)[slots[valid]] = entries.to(kv_cache.dtype)

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
        if attn_metadata is None:  # the profiling run, before the cache exists
            return output.fill_(0)
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        by_slot = _by_slot(kv_cache)
        meta = attn_metadata
        if meta.decode_only:
            entries = by_slot[meta.entry_slots].transpose(1, 2)  # [B, Hkv, L, 2d]
            queries = query[: meta.num_reqs].unsqueeze(2)  # [B, Hq, 1, d]
            lengths = torch.tensor(meta.seq_lens).view(-1, 1, 1, 1)
            visible = meta.entry_valid.view(meta.num_reqs, 1, 1, -1)
            attended = self._attend(queries, entries, visible, lengths - 1)  # each query at position L - 1
            out[: meta.num_reqs] = attended.squeeze(2).to(out.dtype)
            return output
        starts = meta.query_start_loc
        for r in range(meta.num_reqs):
            begin, end = starts[r], starts[r + 1]
            if end == begin:
                continue
            length = meta.seq_lens[r]
            entries = by_slot[meta.entry_slots[r, :length]].transpose(0, 1)  # [Hkv, L, 2d]
            queries = query[begin:end].transpose(0, 1)  # [Hq, n, d]
            positions = torch.arange(length - (end - begin), length).view(1, -1, 1)  # the queries' positions
            visible = torch.ones(1, 1, length, dtype=torch.bool)
            out[begin:end] = self._attend(queries, entries, visible, positions).transpose(0, 1).to(out.dtype)
        return output

    def _attend(
        self, queries: torch.Tensor, entries: torch.Tensor, visible: torch.Tensor, query_positions: torch.Tensor
    ) -> torch.Tensor:
        """`queries [..., Hq, n, d]` over `entries [..., Hkv, L, 2d]` (entry j at position j); `visible`
        broadcasts to `[..., Hq, n, L]` (padding off), and causality and the window come from the positions."""
        keys = entries[..., : self.head_size].to(queries.dtype)
        values = entries[..., self.head_size :].to(queries.dtype)
        key_positions = torch.arange(keys.shape[-2])
        mask = visible & (key_positions <= query_positions)
        if self.sliding_window is not None:
            mask = mask & (query_positions - key_positions < self.sliding_window)
        if self.logits_soft_cap is None:
            return F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
            )
        group = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(group, -3), values.repeat_interleave(group, -3)
        scores = torch.matmul(queries, keys.transpose(-1, -2)).float() * self.scale
        scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return torch.matmul(weights.to(values.dtype), values)


def _by_slot(kv_cache: torch.Tensor) -> torch.Tensor:
    """The layer's cache `[blocks, Hkv, block_size, 2d]` as `[slots, Hkv, 2d]`, slot = block * block_size + offset.
    A view: vLLM's LBNHC layout stores each block's tokens outermost, heads inside them."""
    blocks, heads, block_size, width = kv_cache.shape
    return kv_cache.transpose(1, 2).view(blocks * block_size, heads, width)  # `view` refuses to copy


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
