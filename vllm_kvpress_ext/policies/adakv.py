"""`adakv`: SnapKV scoring with head-wise budgets chosen by a top-k over all heads of a layer.

Paper: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference" (NeurIPS 2025). Reference implementation: `AdaptiveSnapKVCluster` in
`adaptive_snapkv/monkeypatch/snapkv_utils.py` of the authors' AdaKV repository.

Equations, per layer with H KV heads, prompt of n tokens, mean budget B per (layer, KV head) and
protected window w (as resolved by `Budget` and `effective_window`, see `policies/base.py`):

    s_h[j]  = SnapKV votes of head h (see `snapkv.py`), j over the n - w prefix entries
    C       = B - w                                   selectable entries per head, on average
    F       = floor(alpha * C)                        safeguard floor per head
    floor_h = top_F(s_h)                              each head's own best F entries
    rest    = top_{H (C - F)} { s_h[j] : j not in floor_h }   one top-k over the flattened layer
    keep_h  = window  U  floor_h  U  {j : (h, j) in rest}

So every layer keeps exactly H * B entries (H * n when the prompt is no longer than B); heads
whose attention is dispersed get more, concentrated heads less, and none gets fewer than w + F.

Defaults, from the authors' repository: window 32, kernel 7, max pooling (the `c*_w32_k7_maxpool`
configs of its scripts), alpha = 0.2 (the value its scripts use and its README recommends with
GQA). Budget default: ratio 0.25, the project-wide default of the SnapKV family.

Divergences:
- Allocation: the reference counts each head's share c_h of a flattened top-(H C) and then keeps
  round((1 - alpha) c_h + F) entries per head, whose sum can differ from H C by rounding. Here the
  floor is taken first and the remaining H (C - F) entries by the flattened top-k (the order the
  authors reviewed in kvpress's AdaKVPress), which keeps exactly H C and guarantees the floor.
- The floor is alpha times the selectable budget C = B - w, as in the reference
  (`floor_capacity = int((base_capacity - window) * alpha)`), not alpha times B: the window is
  already a per-head guarantee of its own.
- The reference's optional `normalize` reweighting and its `pyram_mode` (Ada + PyramidKV layer
  budgets) are not implemented; `pyramidkv` covers layer-wise allocation on its own.
- GQA: votes of a KV head's query heads are reduced by `gqa_reduction` (mean by default, as the
  reference's GQA support does), so each KV head keeps one set of entries.
"""

from __future__ import annotations

from dataclasses import dataclass
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


def adaptive_head_keep(scores: torch.Tensor, protected: torch.Tensor, selectable: int, floor: int) -> torch.Tensor:
    """Keep mask `[H, n]`: protected entries, each head's best `floor` others, then a flattened top-k.

    Every row keeps its protected entries plus `selectable` others on average: H * selectable in
    total over the layer. Ties break towards lower heads, then lower indices.
    """
    heads, n = scores.shape
    free = scores.float().masked_fill(protected, float("-inf"))
    floor_mask = keep_top(free, torch.full((heads,), floor), torch.zeros_like(protected))
    remaining = heads * (selectable - floor)
    flat = free.masked_fill(floor_mask, float("-inf")).reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices[:remaining]
    chosen = torch.zeros(heads * n, dtype=torch.bool)
    chosen[order] = True
    return protected | floor_mask | chosen.view(heads, n)


@dataclass
class AdaKVPolicy(ObservationWindowScores):
    """Ada-KV (on SnapKV scores); equations, defaults and divergences in the module docstring."""

    name = "adakv"
    summary = "SnapKV votes, head-wise budgets by one top-k over all heads of a layer (Feng et al. 2024)"

    kernel_size: int = 7
    pooling: str = "maxpool"
    alpha: float = 0.2

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.alpha <= 1.0:
            raise PolicyConfigError(
                f"alpha (per-head floor, as a fraction of the selectable budget B - window) must lie in [0, 1], "
                f"got {self.alpha}"
            )

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> torch.Tensor:
        n = layer.length
        budget = self.budget.per_head(n)
        window = self.effective_window(n, budget)
        selectable = budget - window
        floor = int(self.alpha * selectable)
        # Nothing to rank when the window (shrunk to the budget) or the whole prompt is what stays. The top-k runs
        # over all of the layer's heads, on every tensor-parallel worker alike: the mask covers all of them.
        ranked = n > self.window and budget < n
        scores = layer.all_heads(self.scores(layer).cpu()) if ranked else torch.zeros(layer.total_kv_heads, n)
        protected = recent_window(n, window).expand(scores.shape[0], n).contiguous()
        return adaptive_head_keep(scores, protected, selectable, floor)

    def plan(self, request: RequestPrefill, layer_results: list[Any], state: dict[str, Any]) -> KeepPlan:
        return KeepPlan.from_mask(torch.stack(layer_results))
