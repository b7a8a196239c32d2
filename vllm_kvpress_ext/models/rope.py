"""Rotary position embeddings in the HF "rotate_half" layout.

HF checkpoints of the Llama family permute q/k weights so that RoPE rotates the pair
(x[i], x[i + d/2]) rather than (x[2i], x[2i+1]); we must use the same pairing or the loaded weights
would be scrambled. cos/sin are therefore laid out as `cat(freqs, freqs)` over the head dimension.

Frequencies stay in fp32 whatever the model dtype: bf16 angles at positions in the thousands would
be off by whole radians. They are computed on the fly from positions (one [T, d/2] outer product),
so there is no [max_position, d] table to hold for 128k-context models.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> Tensor:
    """fp32 [head_dim // 2] angular speeds, one per rotated pair, after context-extension scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "linear":
        # Position interpolation: slowing every frequency by `factor` is the same as dividing positions.
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: Tensor, s: RopeScaling) -> Tensor:
    """Llama 3.1 scaling: keep high frequencies, slow low ones by `factor`, blend the band in between.

    A frequency's wavelength (in tokens) decides its band: shorter than original_ctx/high_freq_factor
    is "high" (local detail, untouched), longer than original_ctx/low_freq_factor is "low" (divided by
    factor), and in between the two results are mixed linearly in original_ctx / wavelength.
    """
    assert s.original_max_position_embeddings is not None  # guaranteed by RopeScaling
    original_ctx = float(s.original_max_position_embeddings)
    wavelength = 2 * math.pi / inv_freq
    slowed = inv_freq / s.factor
    smooth = (original_ctx / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    is_low = wavelength > original_ctx / s.low_freq_factor
    is_high = wavelength < original_ctx / s.high_freq_factor
    return torch.where(is_low, slowed, torch.where(is_high, inv_freq, blended))


class RotaryEmbedding(nn.Module):
    """Maps token positions to the (cos, sin) pair that `apply_rope` consumes.

    `inv_freq` is deliberately a plain attribute, not a buffer: `model.to(torch.bfloat16)` must not
    round it, and building the model on the meta device (the loader does, to skip random init) must
    not leave it without data. It follows the positions' device on first use.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling or RopeScaling()
        self.inv_freq = inverse_frequencies(head_dim, theta, self.scaling)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin, each [T, head_dim], for integer positions [T]; fp32 unless `dtype` is given."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if dtype is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling.rope_type}"


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim: the 90° turn of each (x[i], x[i + d/2]) pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, H, d] by per-token angles; cos/sin [T, d] are shared by all H heads."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    return x * cos + rotate_half(x) * sin
