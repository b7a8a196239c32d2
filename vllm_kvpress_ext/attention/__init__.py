"""Attention ops over the ragged per-head paged cache.

`reference` holds the pure-torch oracles; `ops` dispatches each public op to a Triton kernel when its
tensors are on CUDA (see `ops.py` for the rule) and to the reference everywhere else.
"""

from vllm_kvpress_ext.attention.ops import (
    causal_attention,
    causal_attention_with_lse,
    copy_slots,
    gated_chunk_attention,
    gather_paged,
    paged_decode_attention,
    paged_prefill_attention,
    ring_chunk_attention,
    sliding_window_attention,
    varlen_causal_attention,
    vertical_slash_attention,
    window_scores,
    write_kv,
)

__all__ = [
    "causal_attention",
    "causal_attention_with_lse",
    "copy_slots",
    "gated_chunk_attention",
    "gather_paged",
    "paged_decode_attention",
    "paged_prefill_attention",
    "ring_chunk_attention",
    "sliding_window_attention",
    "varlen_causal_attention",
    "vertical_slash_attention",
    "window_scores",
    "write_kv",
]
