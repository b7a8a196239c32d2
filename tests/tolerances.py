"""Tolerances for comparing two correct float computations, from the dtype and the reductions involved.

Two correct paths to one value (another batch shape, another GEMM kernel, AVX2 instead of AVX-512)
sum the same terms in different orders, so they differ by rounding. For a sum of n terms the
rounding errors, of random sign, grow like sqrt(n) * eps (the probabilistic form of the bound in
Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 4; the worst case is n * eps). We allow
4 * sqrt(n) * eps per reduction, relative to the value's size, and let the errors of reductions done
one after another (a model's layers) add up. What a tolerance may never come from is the difference
one machine happened to show.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def reduction_atol(dtype: torch.dtype, reduction_length: int, magnitude: float = 1.0, chained: int = 1) -> float:
    """Absolute tolerance for a value of size `magnitude` computed through `chained` reductions of
    `reduction_length` terms each."""
    if reduction_length < 1 or chained < 1:
        raise ValueError("reduction_length and chained must be >= 1")
    return 4.0 * torch.finfo(dtype).eps * math.sqrt(reduction_length) * chained * max(abs(magnitude), 1.0)


def logprob_atol(dtype: torch.dtype, config: Any, logprob: float) -> float:
    """How far one log-probability may differ between two correct forward passes of a model: each layer's
    attention and MLP, then the head, each a GEMM over at most the widest inner dimension."""
    widest = max(config.hidden_size, config.intermediate_size, config.vocab_size)
    return reduction_atol(dtype, widest, magnitude=logprob, chained=2 * config.num_hidden_layers + 1)
