"""The model's dense projections, through oneDNN on the CPU where this CPU runs it.

torch's `F.linear` on a CPU goes to MKL's sgemm. On the AMD EPYC development machine (AVX-512) it ran
this model's projections (576 x 1536 and friends, 1 to 2,048 rows) at 0.5x to 0.7x the speed of
oneDNN's JIT-compiled kernels (`kvpress bench linear`). oneDNN is what torch's own
`torch.ops.mkldnn._linear_pointwise` (the op torch.compile's CPU backend emits) runs. So every
projection of the model goes through `linear` below: that op on CPU tensors when torch was built with
oneDNN, no gradient is needed and oneDNN has a kernel for the dtype on this CPU; `F.linear` otherwise
(CUDA, training the write gates, or `KVPRESS_DISABLE_ONEDNN_LINEAR=1` in the environment the process
starts with). The two differ by float rounding only (summation order), as batching already makes
`F.linear` differ from itself.

Which dtypes oneDNN runs depends on the CPU: bf16 needs AVX-512 (or AVX2 with VNNI-2); on an
AVX2-only x86-64 CPU, or with `ONEDNN_MAX_CPU_ISA=AVX2`, creating the bf16 inner product fails with
"could not create a primitive descriptor". So each dtype is tried once, on a tiny product, the first
time a projection of that dtype runs, and the answer is kept for the life of the process.

A half dtype (bf16, fp16) that oneDNN cannot run goes to `F.linear` for a few rows, and for 16 rows
or more is widened to fp32 for oneDNN's fp32 product, the result rounded back. ATen's own half GEMM
on such a CPU runs at about 40 GFLOP/s whatever the rows, where widening costs one pass over the
weights and then runs at fp32's speed. SmolLM2-135M's 210 projections, `ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2` on the development machine, bf16, ms per pass: 1 row F.linear 8.4 /
widened 51.6; 16 rows 92.3 / 58.3; 64 rows 349 / 156; 512 rows 2,716 / 664 (fp16 on the AVX-512
machine, which has no fp16 oneDNN kernel either: 16 rows 90.8 / 57.6, 64 rows 346 / 160). Widening
computes in fp32 and rounds once, so it is at least as exact as the half product.
`path_for(dtype)` says what was chosen (`kvpress info`, the engine's startup log).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vllm_kvpress_ext.utils.flags import env_flag

DISABLE_ENV = "KVPRESS_DISABLE_ONEDNN_LINEAR"
#: The dtypes worth sending to oneDNN as they are (fp16 is widened, below).
CANDIDATE_DTYPES = (torch.float32, torch.bfloat16)
HALF_DTYPES = (torch.bfloat16, torch.float16)
#: From this many rows a half projection oneDNN cannot run is widened to fp32 (see the module docstring).
WIDEN_MIN_ROWS = 16


def _enabled() -> bool:
    if env_flag(DISABLE_ENV):
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# Decided once, at import (set KVPRESS_DISABLE_ONEDNN_LINEAR before starting the process): the check
# runs for every projection of every step, and reading the environment there cost about 1% of a
# served decode step.
ONEDNN_ENABLED = _enabled()
# dtype -> whether oneDNN's inner product runs on this CPU: filled on first use of each dtype, on the
# thread that runs the model (a probe at import would start an OpenMP team on the importing thread).
_RUNS: dict[torch.dtype, bool] = {}


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    out: Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


def _probe(dtype: torch.dtype) -> bool:
    """Run a 2 x 16 by 16 x 8 product through oneDNN once; False if it cannot (or is not enabled)."""
    if not ONEDNN_ENABLED or dtype not in CANDIDATE_DTYPES:
        return False
    try:
        _onednn(torch.ones(2, 16, dtype=dtype), torch.ones(8, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether projections of `dtype` go through oneDNN in this process (probed once per dtype)."""
    runs = _RUNS.get(dtype)
    if runs is None:
        runs = _RUNS[dtype] = _probe(dtype)
    return runs


def path_for(dtype: torch.dtype) -> str:
    """What runs projections of `dtype` on the CPU here, in words (`kvpress info`, the startup log)."""
    if not ONEDNN_ENABLED:
        why = f"{DISABLE_ENV} is set" if os.environ.get(DISABLE_ENV) else "no oneDNN"
        return f"F.linear ({why})"
    if onednn_runs(dtype):
        return "oneDNN"
    if dtype in HALF_DTYPES and onednn_runs(torch.float32):
        return f"F.linear below {WIDEN_MIN_ROWS} rows, else oneDNN in float32 (no {_name(dtype)} kernel here)"
    return "F.linear"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _widened(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """A half projection through oneDNN's fp32 product, rounded back to the half dtype."""
    wide_bias = None if bias is None else bias.float()
    return _onednn(x.float(), weight.float(), wide_bias).to(x.dtype)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN where it serves (see the module docstring)."""
    if (
        ONEDNN_ENABLED
        and x.is_cpu
        and x.dtype == weight.dtype
        and not (x.requires_grad or weight.requires_grad)  # the op has no backward
    ):
        if onednn_runs(x.dtype):
            try:
                return _onednn(x, weight, bias)
            except RuntimeError as error:  # a shape the probe did not cover: never a user-facing oneDNN error
                _RUNS[x.dtype] = False
                warnings.warn(f"oneDNN linear failed in {x.dtype} ({error}); using F.linear from now on", stacklevel=2)
        elif x.dtype in HALF_DTYPES and x.numel() >= WIDEN_MIN_ROWS * x.shape[-1] and onednn_runs(torch.float32):
            return _widened(x, weight, bias)
    return F.linear(x, weight, bias)


#: The row count oneDNN is told to expect when a weight is packed (`pack_weight`): the blocked layout it picks
#: serves every row count, this one only steers the choice. Timed over SmolLM2-135M's 210 projections and its
#: head (fp32, 2 threads, a Xeon with AVX-512, passes as `kvpress bench linear --head` makes), ms a pass, plain
#: weight / packed for 32 / 128 / 512 rows: 1 row 30.2 / 25.6 / 24.5 / 24.0; 16 rows 47.7 / 38.5 / 36.1 / 35.5;
#: 64 rows 83.4 / 79.1 / 76.7 / 76.2; 2,048 rows 1,823 / 1,649 / 1,658 / 1,674; with `ONEDNN_MAX_CPU_ISA=AVX2`,
#: 16 rows 55.9 / 55.7 / 52.3 / 51.8 and 2,048 rows 2,597 / 2,556 / 2,491 / 2,494. 128 is within noise of the
#: best everywhere.
PACKED_FOR_ROWS = 128


def pack_weight(weight: Tensor) -> Tensor | None:
    """`weight` (`[out, in]`) reordered once into the blocked layout oneDNN's inner product reads, for
    `packed_linear`; None where oneDNN does not run its dtype on this CPU (`linear` serves it then).

    A plain weight is reordered (or read strided) by oneDNN on every call; packed, a decode step's projections
    run 1.2x (SmolLM2-135M) to 1.3x (Gemma 3 270M) faster at 16 rows (`kvpress bench linear --head`). vLLM's CPU
    build packs its projections the same way. The packed tensor is opaque (`torch._mkldnn` layout): nothing but
    `packed_linear` reads it."""
    if not (ONEDNN_ENABLED and weight.is_cpu and weight.dim() == 2 and onednn_runs(weight.dtype)):
        return None
    try:
        packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_FOR_ROWS)
    except RuntimeError:
        return None
    return packed


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` for the weight `pack_weight` packed; the same float rounding as `linear`'s oneDNN
    path up to summation order."""
    return _onednn(x, packed, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) whose forward is `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
