"""The building blocks of a Llama-family decoder: RMSNorm, SwiGLU MLP, attention, decoder layer.

Everything works on flat [T, ...] tensors (a varlen batch of several sequences concatenated), with
no Python loop over tokens or heads. Module and parameter names follow the HF checkpoints
(`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...) so the loader maps names 1:1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import AttentionContext
from .config import ModelConfig
from .linear import Linear
from .rope import RotaryEmbedding, apply_rope


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in fp32.

    The normalised value is cast back to the input dtype *before* the weight multiply, which is what
    the HF checkpoints were trained with; doing the multiply in fp32 would drift in bf16.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(d, f, bias=bias)
        self.up_proj = Linear(d, f, bias=bias)
        self.down_proj = Linear(f, d, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)).mul_(self.up_proj(x)))  # in place: one T x F buffer fewer


class Attention(nn.Module):
    """Grouped-query self-attention whose core (cache + softmax) is delegated to an AttentionContext.

    This module owns only the projections, the optional per-head q/k RMSNorm (Qwen3) and RoPE; the
    context receives q/k/v and returns the per-head output that o_proj mixes back.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = Linear(d, self.num_heads * hd, bias=config.attention_bias)
        self.k_proj = Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.v_proj = Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.o_proj = Linear(self.num_heads * hd, d, bias=config.o_proj_bias)
        self.q_norm: RMSNorm | None = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary  # shared with the model and every layer; holds no parameters

    def _queries(self, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The one q path (projection, bias, q_norm, RoPE), shared by forward and project_queries."""
        q = self.q_proj(hidden).view(hidden.shape[0], self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def project_queries(self, hidden: Tensor, positions: Tensor) -> Tensor:
        """Post-RoPE queries [T, Hq, d] for (possibly synthetic) normed hidden states [T, D] at positions [T].

        Compression policies use this to ask "what would a query at this position look like" without
        running attention; it is bit-identical to the q that forward hands to the context.
        """
        cos, sin = self.rotary.cos_sin(positions, dtype=hidden.dtype)
        return self._queries(hidden, cos, sin)

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext) -> Tensor:
        """hidden [T, D] (already input-normed) -> attention block output [T, D]."""
        t = hidden.shape[0]
        q = self._queries(hidden, cos, sin)
        k = self.k_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        out = ctx.attend(self.layer_idx, hidden, q, apply_rope(k, cos, sin), v, k)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, rotary)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))
