"""The model's dense projections, through oneDNN on the CPU.

torch's `F.linear` on a CPU goes to MKL's sgemm. On the AMD EPYC development machine (AVX-512) MKL's
small- and mid-sized fp32 GEMMs ran at under half the speed of oneDNN's JIT-compiled ones for this
model's shapes (576 x 1536 and friends, 16 to 2,048 rows; `kvpress bench linear` measures it), and
oneDNN is what torch's own `torch.ops.mkldnn._linear_pointwise` (the op torch.compile's CPU
backend emits) runs. So every projection of the model goes through `linear` below: that op on CPU
tensors when torch was built with oneDNN and no gradient is needed, `F.linear` otherwise (CUDA,
training the write gates, `KVPRESS_DISABLE_ONEDNN_LINEAR=1`). The two differ by float rounding only
(summation order), as batching already makes `F.linear` differ from itself.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DISABLE_ENV = "KVPRESS_DISABLE_ONEDNN_LINEAR"


@functools.cache
def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _use_onednn(x: Tensor, weight: Tensor) -> bool:
    if x.device.type != "cpu" or weight.device.type != "cpu" or x.dtype != weight.dtype:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False  # the op has no backward
    if os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        return False
    return x.dtype in (torch.float32, torch.bfloat16) and _onednn_available()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN where it serves (see the module docstring)."""
    if _use_onednn(x, weight):
        out: Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) whose forward is `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
