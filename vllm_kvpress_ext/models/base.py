"""The seam between model code and the engine: the attention context.

The model never owns a KV cache. Each attention layer projects q/k/v, applies RoPE, and hands the
tensors (by reference, no copies) to a context that stores what it wants (paged per-head pool,
compression-policy capture) and computes attention however it likes (dense reference, paged decode
kernel). That keeps the model file free of cache logic and lets one model serve the embedded
engine, tests and benchmarks with different contexts.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class AttentionContext(Protocol):
    """What the engine passes to `LlamaFamilyForCausalLM.forward` for one flat varlen batch.

    The batch is T new tokens of several sequences concatenated; the context knows where each
    sequence starts, what its cached prefix is, and which cache slots the new tokens go to.
    """

    def attend(self, layer_idx: int, hidden: Tensor, q: Tensor, k: Tensor, v: Tensor, k_pre_rope: Tensor) -> Tensor:
        """Store this layer's new keys/values and return the attention output.

        hidden: [T, D] the attention input (after input_layernorm), for policies that score hidden
        states; q: [T, Hq, d] and k: [T, Hkv, d] after RoPE (and after q_norm/k_norm for Qwen3);
        v: [T, Hkv, d]; k_pre_rope: [T, Hkv, d] after k_norm, before RoPE (for policies that
        re-rotate keys). Returns [T, Hq, d], the attention output before o_proj, softmax scaled by
        1/sqrt(d), causal within each sequence, query head h reading KV head h // (Hq // Hkv).
        """
        ...
