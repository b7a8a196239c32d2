"""Attention ops over the ragged per-head paged cache.

`reference` holds the pure-torch oracles; accelerated kernels dispatch from here on CUDA tensors.
"""

from vllm_kvpress_ext.attention.reference import (
    causal_attention,
    gather_paged,
    paged_decode_attention,
    paged_prefill_attention,
    varlen_causal_attention,
    vertical_slash_attention,
)

__all__ = [
    "causal_attention",
    "gather_paged",
    "paged_decode_attention",
    "paged_prefill_attention",
    "varlen_causal_attention",
    "vertical_slash_attention",
]
