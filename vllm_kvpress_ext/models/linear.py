"""The model's dense projections, through oneDNN on the CPU.

torch's `F.linear` on a CPU goes to MKL's sgemm. On the AMD EPYC development machine (AVX-512) it ran
this model's projections (576 x 1536 and friends, 1 to 2,048 rows) at 0.5x to 0.7x the speed of
oneDNN's JIT-compiled kernels (`kvpress bench linear`). oneDNN is what torch's own
`torch.ops.mkldnn._linear_pointwise` (the op torch.compile's CPU backend emits) runs. So every
projection of the model goes through `linear` below: that op on CPU tensors when torch was built with
oneDNN and no gradient is needed; `F.linear` otherwise (CUDA, training the write gates, or
`KVPRESS_DISABLE_ONEDNN_LINEAR=1` in the environment the process starts with). The two differ by
float rounding only (summation order), as batching already makes `F.linear` differ from itself.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DISABLE_ENV = "KVPRESS_DISABLE_ONEDNN_LINEAR"


def _enabled() -> bool:
    if os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# Decided once, at import (set KVPRESS_DISABLE_ONEDNN_LINEAR before starting the process): the check
# runs for every projection of every step, and reading the environment there cost about 1% of a
# served decode step.
ONEDNN_ENABLED = _enabled()
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN where it serves (see the module docstring)."""
    if (
        ONEDNN_ENABLED
        and x.is_cpu
        and x.dtype == weight.dtype
        and x.dtype in _ONEDNN_DTYPES
        and not (x.requires_grad or weight.requires_grad)  # the op has no backward
    ):
        out: Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) whose forward is `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
