"""`pyramidkv`: SnapKV scoring with a per-layer budget that shrinks linearly with depth.

Paper: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling" (2024). Reference implementation: `pyramidkv/pyramidkv_utils.py` (`PyramidKVCluster`)
in the authors' KVCache-Factory / PyramidKV repository.

Two layer schedules (`schedule`), for a prompt of n tokens, L layers, mean budget B per (layer, KV
head) and protected window w (both as resolved by `Budget` and `effective_window`, see
`policies/base.py`). Both keep, per layer and KV head, the window plus the best-voted other entries
up to the layer's budget b_l; they differ in where the window sits.

`schedule: window_outside` (default; the authors' KVCache-Factory layout): the pyramid is built on the
selectable budget R = B - w and the window is added to every layer, so the top layer keeps
w + R / beta:

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

`schedule: window_inside` (the schedule of NVIDIA kvpress 0.5.5's `PyramidKVPress.get_layer_budget`):
the pyramid is built on the whole budget and the window counts inside each layer's b_l, so the top
layer keeps B / beta in all; a pyramid whose top layer would be smaller than the window is not
built and every layer keeps B (plain SnapKV):

    B*       = r n for a `ratio` budget r (not rounded), `tokens` for a `tokens` budget
    top      = B* / beta;   bottom = 2 B* - top
    if bottom >= n - w:  bottom = n - w;  top = 2 B* - bottom
    if not (n >= bottom >= top >= w):  b_l = B for every layer    (B = round(r n) or `tokens`)
    else:   b_l = max(1, round_half_even(bottom - (bottom - top) * l / (L - 1)))

Each layer is rounded on its own (as that implementation does), so the mean over layers can differ
from B* by a fraction of an entry; the budgets are computed in floating point in the same order of
operations, so the integers are the same as that implementation's for the same n, ratio and window.
Note the cap: the bottom layer holds at most n - w entries in all, window included, where the
window_outside schedule lets it hold the whole prompt.

Over-long layers (window_outside): a layer's budget never exceeds the prompt; the reference's rule applies (when
the bottom layer would exceed n - w, the line is flattened so the bottom keeps the whole prompt
and the mean is preserved: budget is redistributed, never silently lost). A prompt no longer than
B is kept whole in every layer (base semantics).

Models with sliding-window layers (Gemma 3): the pyramid runs over the global layers only, bottom to
top in model order (a sliding layer's ring holds its window whatever the schedule), so its mean is the
budget of the layers that grow with the prompt.

Defaults, from the authors' LongBench driver (`run_longbench.py` in KVCache-Factory, the setting
behind the paper's tables): window 8, kernel 7, max pooling; beta = 20 (the `PyramidKVCluster`
default). Budget default: ratio 0.25, the project-wide default of the SnapKV family.

Divergences (window_outside, against KVCache-Factory):
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
    check_choice,
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


def pyramid_budgets_window_inside(
    num_layers: int, mean: float, length: int, window: int, beta: float, uniform: int
) -> list[int]:
    """Entries kept per head of each layer, window included (`schedule: window_inside`, module docstring).

    `mean` is B* (real-valued), `uniform` the budget every layer keeps when no pyramid fits.
    """
    if num_layers < 1:
        raise ValueError("num_layers must be >= 1")
    # (window + B*) - window is B* up to floating point: the same expression as that implementation's,
    # so a layer that lands on .5 rounds the same way.
    selectable = (window + mean) - window
    top = selectable / beta
    bottom = selectable * 2 - top
    if bottom >= length - window:
        bottom = length - window
        top = selectable * 2 - bottom
    if not length >= bottom >= top >= window:
        return [uniform] * num_layers
    step = (bottom - top) / (num_layers - 1) if num_layers > 1 else 0.0
    # Python's round: half to even, as the implementation this schedule reproduces. At least one entry:
    # with window 0 the top layers could round to nothing, and every budget here keeps one entry per head.
    return [max(1, round(bottom - layer * step)) for layer in range(num_layers)]


PYRAMID_SCHEDULES = ("window_outside", "window_inside")


@dataclass
class PyramidKVPolicy(ObservationWindowScores):
    """PyramidKV; equations, defaults and divergences in the module docstring."""

    name = "pyramidkv"
    decides_across_layers = True  # its budgets follow a schedule over the whole layer stack
    summary = "SnapKV votes with per-layer budgets shrinking linearly with depth (Cai et al. 2024)"

    window: int = 8
    kernel_size: int = 7
    pooling: str = "maxpool"
    beta: float = 20.0
    schedule: str = "window_outside"

    def validate(self) -> None:
        super().validate()
        check_choice("schedule", self.schedule, PYRAMID_SCHEDULES)
        if not self.beta >= 1.0:
            raise PolicyConfigError(
                f"beta must be >= 1 (top layer keeps 1/beta of the mean; 1 = uniform), got {self.beta}"
            )

    def layer_budgets(self, num_layers: int, length: int) -> list[int]:
        """Entries kept per KV head of each layer (window included) for a prompt of `length` entries."""
        budget = self.budget.per_head(length)
        window = self.effective_window(length, budget)
        if self.schedule == "window_inside":
            if budget >= length:  # a prompt no longer than the budget is kept whole (base semantics)
                return [length] * num_layers
            mean = self.ratio * length if self.ratio is not None else float(budget)
            return pyramid_budgets_window_inside(num_layers, mean, length, window, self.beta, budget)
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
