"""The building blocks of a Llama-family decoder: RMSNorm, gated MLP, attention, decoder layer.

Gemma 3's variants are switches of the same blocks (`ModelConfig.norm_offset`, `sandwich_norms`,
`hidden_act`): its norms multiply by (1 + weight) in fp32, its MLP gates with GELU (tanh), and its
layers add a norm after attention and around the MLP.

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

    With `offset` (Gemma) the weight is stored as an offset from 1 and the multiply happens in fp32
    before the cast back, as Gemma's checkpoints were trained.
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def norm(config: ModelConfig, dim: int) -> RMSNorm:
    """An RMSNorm of `dim` as the model's family computes it."""
    return RMSNorm(dim, config.rms_norm_eps, offset=config.norm_offset)


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or GELU with the tanh approximation."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(d, f, bias=bias)
        self.up_proj = Linear(d, f, bias=bias)
        self.down_proj = Linear(f, d, bias=bias)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x)
        activated = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(activated.mul_(self.up_proj(x)))  # in place: one T x F buffer fewer


class Attention(nn.Module):
    """Grouped-query self-attention whose core (cache + softmax) is delegated to an AttentionContext.

    This module owns only the projections, the optional per-head q/k RMSNorm (Qwen3, Gemma 3) and RoPE;
    the context receives q/k/v and returns the per-head output that o_proj mixes back. `rotary` is the
    layer's own: Gemma 3's sliding-window layers rotate with a base of their own.
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
        self.q_norm: RMSNorm | None = norm(config, hd) if config.qk_norm else None
        self.k_norm: RMSNorm | None = norm(config, hd) if config.qk_norm else None
        self.rotary = rotary  # shared with the model and the layers of its kind; holds no parameters

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
        """hidden [T, D] (already input-normed) -> attention block output [T, D]; cos/sin from `self.rotary`."""
        t = hidden.shape[0]
        q = self._queries(hidden, cos, sin)
        k = self.k_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        out = ctx.attend(self.layer_idx, hidden, q, apply_rope(k, cos, sin), v, k)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.)).

    With `sandwich_norms` (Gemma 3) each branch's output is normed too before the residual add:
    x + post_attention_norm(attn(input_norm(x))), then + post_feedforward_norm(mlp(pre_feedforward_norm(.))).
    HF names the norm before the MLP `post_attention_layernorm` in Llama and `pre_feedforward_layernorm`
    in Gemma 3, where `post_attention_layernorm` is the attention branch's output norm.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, rotary)
        self.mlp = MLP(config)
        d = config.hidden_size
        self.input_layernorm = norm(config, d)
        self.post_attention_layernorm = norm(config, d)
        self.pre_feedforward_layernorm: RMSNorm | None = norm(config, d) if config.sandwich_norms else None
        self.post_feedforward_layernorm: RMSNorm | None = norm(config, d) if config.sandwich_norms else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: AttentionContext) -> Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            h = x + attended
            return h + self.mlp(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(attended)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
