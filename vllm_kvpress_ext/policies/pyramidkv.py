"""`pyramidkv`: SnapKV scoring with a per-layer budget that shrinks linearly with depth.

Paper: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling" (2024). Reference implementation: `pyramidkv/pyramidkv_utils.py` (`PyramidKVCluster`)
in the authors' KVCache-Factory / PyramidKV repository.

Equations, for a prompt of n tokens, L layers, mean budget B per (layer, KV head) and protected
window w (both as resolved by `Budget` and `effective_window`, see `policies/base.py`):

    R        = B - w                                  selectable entries per head, on average
    r_top    = R / beta                               top layer (smallest)
    r_bottom = 2 R - r_top                            bottom layer (largest)
    if r_bottom > n - w:                              a layer cannot keep more than the prompt:
        r_bottom = n - w;  r_top = 2 R - r_bottom     flatten the line, same mean (as the reference)
    r_l      = r_bottom - (r_bottom - r_top) * l / (L - 1)     arithmetic sequence, l = 0 .. L-1
    b_l      = round_exact(r_l) + w                   entries kept per head of layer l

    per layer and KV head: SnapKV votes (see `snapkv.py`) s = pool1d(sum_window softmax(q k^T / sqrt(d)))
    keep_l   = window  U  top_{b_l - w}(s)

`round_exact` rounds the real-valued schedule to integers whose sum is exactly L * R (floors,
then one extra entry to the layers with the largest fractional parts, ties to the lower layer).
This keeps the schedule non-increasing with depth, every layer within one entry of the real
schedule, and the mean over layers of kept entries per head equal to B exactly.

Over-long layers: a layer's budget never exceeds the prompt; the reference's rule applies (when
the bottom layer would exceed n - w, the line is flattened so the bottom keeps the whole prompt
and the mean is preserved: budget is redistributed, never silently lost). A prompt no longer than
B is kept whole in every layer (base semantics).

Defaults, from the authors' LongBench driver (`run_longbench.py` in KVCache-Factory, the setting
behind the paper's tables): window 8, kernel 7, max pooling; beta = 20 (the `PyramidKVCluster`
default). Budget default: ratio 0.25, the project-wide default of the SnapKV family.

Divergences:
- Integer rounding: the reference floors `(R)/beta` and the step `(r_bottom - r_top) // (L - 1)`,
  so its mean differs from B by up to a few entries per layer; here the mean is exact.
- GQA: votes of a KV head's query heads are reduced by `gqa_reduction` (mean by default), as in
  `snapkv.py`, so each KV head keeps one set of entries.
- Budget is `ratio` or `tokens` per (layer, KV head), window included (the reference's
  `max_capacity_prompt`); the window shrinks to the budget when a ratio budget is smaller.
- The reference's mid-length branch (prompt between B and 2 (B - w)) uses the flat SnapKV budget;
  here the (flattened, capped) pyramid applies to every prompt longer than B.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.policies.base import (
    LayerPrefill,
    PolicyConfigError,
    RequestPrefill,
    keep_top,
    recent_window,
)
from vllm_kvpress_ext.policies.snapkv import ObservationWindowScores


def pyramid_budgets(num_layers: int, selectable: int, cap: int, beta: float) -> list[int]:
    """Per-layer selectable entries (window excluded): non-increasing, each <= `cap`, summing to L * selectable.

    `selectable` is R = B - w, `cap` is n - w (what a layer can hold at most besides its window).
    """
    if num_layers < 1:
        raise ValueError("num_layers must be >= 1")
    if not 0 <= selectable <= cap:
        raise ValueError(f"selectable {selectable} must lie in [0, cap={cap}]")
    mean = Fraction(selectable)
    if num_layers == 1:
        return [selectable]
    top = mean / Fraction(beta)
    bottom = 2 * mean - top
    if bottom > cap:
        bottom = Fraction(cap)
        top = 2 * mean - bottom
    step = (bottom - top) / (num_layers - 1)
    ideal = [bottom - step * layer for layer in range(num_layers)]
    floors = [int(x) for x in ideal]  # all >= 0, so int() floors
    deficit = num_layers * selectable - sum(floors)
    # Largest fractional part first; ties go to the lower (larger-budget) layer.
    order = sorted(range(num_layers), key=lambda i: (-(ideal[i] - floors[i]), i))
    for i in order[:deficit]:
        floors[i] += 1
    return floors


@dataclass
class PyramidKVPolicy(ObservationWindowScores):
    """PyramidKV; equations, defaults and divergences in the module docstring."""

    name = "pyramidkv"
    summary = "SnapKV votes with per-layer budgets shrinking linearly with depth (Cai et al. 2024)"

    window: int = 8
    kernel_size: int = 7
    pooling: str = "maxpool"
    beta: float = 20.0

    def validate(self) -> None:
        super().validate()
        if not self.beta >= 1.0:
            raise PolicyConfigError(
                f"beta must be >= 1 (top layer keeps 1/beta of the mean; 1 = uniform), got {self.beta}"
            )

    def layer_budgets(self, num_layers: int, length: int) -> list[int]:
        """Entries kept per KV head of each layer (window included) for a prompt of `length` entries."""
        budget = self.budget.per_head(length)
        window = self.effective_window(length, budget)
        selectable = pyramid_budgets(num_layers, budget - window, length - window, self.beta)
        return [r + window for r in selectable]

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> torch.Tensor:
        n = layer.length
        if n <= self.window or self.budget.per_head(n) >= n:
            # Nothing to rank: the window (shrunk to the budget) or the whole prompt is what stays.
            return torch.zeros(layer.num_kv_heads, n)
        return self.scores(layer).cpu()

    def plan(self, request: RequestPrefill, layer_results: list[Any], state: dict[str, Any]) -> KeepPlan:
        scores = torch.stack(layer_results)  # [L, Hkv, n]
        num_layers, heads, n = scores.shape
        budgets = self.layer_budgets(num_layers, n)
        window = self.effective_window(n, self.budget.per_head(n))
        protected = recent_window(n, window).expand(heads, n)
        masks = [
            keep_top(scores[layer], torch.full((heads,), budgets[layer]), protected) for layer in range(num_layers)
        ]
        return KeepPlan.from_mask(torch.stack(masks))
