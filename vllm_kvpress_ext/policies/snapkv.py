"""`snapkv`: observation-window attention votes with 1-D pooling.

Paper: Li et al., "SnapKV: LLM Knows What You Are Looking For Before Generation" (NeurIPS 2024).

Equations, per layer and KV head h, prompt of n tokens, observation window of the last w queries:

    A[i, j]  = softmax_j(q_i . k_j / sqrt(d))       i in window, causal (j <= position of i)
    v[j]     = sum_{i in window} A[i, j]             for prefix tokens j < n - w
    s        = pool1d(v, kernel_size)                 neighbours of a voted token score too
    keep     = window  U  top_{B - w}(s)              B = entries kept per head

Defaults follow the authors' reference implementation (`snapkv_utils.py`): window 32, kernel 5,
average pooling with the padding counted (`count_include_pad=True`: PyTorch's `avg_pool1d` default,
which the reference and kvpress use; the first and last kernel_size // 2 prefix entries are averaged
with zeros, see `pool_scores` in `policies/base.py`). `count_include_pad=False` averages over the real
neighbours only. (kvpress uses window 64; KVCache-Factory's configs use max pooling with kernel 7;
both are one field away.)

Divergences:
- GQA: the paper's models repeat KV heads and select per query head, which saves no memory under
  GQA. Here the votes of a KV head's query heads are reduced (`gqa_reduction`, default mean, as
  kvpress and AdaKV's GQA support do) so each KV head keeps one set of pages.
- Budget is `ratio` or `tokens` per (layer, KV head) with the window included (the reference's
  `max_capacity_prompt`); see `policies/base.py` for the semantics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.policies.base import (
    GQA_REDUCTIONS,
    Budget,
    KVPolicy,
    LayerPrefill,
    PolicyConfigError,
    RequestPrefill,
    captured_window_votes,
    check_choice,
    check_flag,
    keep_top,
    pool_scores,
    recent_window,
    reduce_group,
)
from vllm_kvpress_ext.policies.capture import CaptureSpec


@dataclass
class ObservationWindowScores(KVPolicy):
    """Shared fields and scoring of the SnapKV family (SnapKV, PyramidKV, AdaKV)."""

    ratio: float | None = 0.25
    tokens: int | None = None
    window: int = 32
    kernel_size: int = 5
    pooling: str = "avgpool"
    gqa_reduction: str = "mean"
    count_include_pad: bool = True

    @property
    def budget(self) -> Budget:
        return Budget(ratio=self.ratio, tokens=self.tokens)

    def validate(self) -> None:
        if self.window < 0:
            raise PolicyConfigError(f"window must be >= 0, got {self.window}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise PolicyConfigError(f"kernel_size must be a positive odd number, got {self.kernel_size}")
        check_choice("pooling", self.pooling, ("avgpool", "maxpool"))
        check_choice("gqa_reduction", self.gqa_reduction, GQA_REDUCTIONS)
        check_flag("count_include_pad", self.count_include_pad)
        self.budget.validate(self.window)

    def capture_spec(self) -> CaptureSpec:
        return CaptureSpec(window=max(1, self.window))

    def effective_window(self, length: int, budget: int) -> int:
        """The protected window: never longer than the prompt or the budget (see base docstring)."""
        return min(self.window, length, budget)

    def _window_queries(self, layer: LayerPrefill) -> int:
        """How many captured queries form the observation window (one if the window is 0)."""
        return min(self.window, layer.length) or 1

    def query_votes(self, layer: LayerPrefill) -> torch.Tensor:
        """Window votes per query head `[Hq, n]`: each entry's attention summed over the window's queries."""
        return captured_window_votes(layer, self._window_queries(layer), "sum", None)

    def scores(self, layer: LayerPrefill, query_votes: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled window votes `[Hkv, n]` (window entries get +inf: they are always kept).

        `query_votes` (from `query_votes`) saves recomputing them when the caller already has them;
        without them the votes come reduced per KV head from `window_votes` (on CUDA, the Triton kernel).
        """
        n = layer.length
        w = min(self.window, n)
        if query_votes is None:
            votes = captured_window_votes(layer, self._window_queries(layer), "sum", self.gqa_reduction)
        else:
            votes = reduce_group(query_votes, layer.num_kv_heads, self.gqa_reduction)  # [Hkv, n]
        prefix = n - w
        scores = votes.clone()
        if prefix > 0:  # a prompt no longer than the window has nothing to rank
            scores[:, :prefix] = pool_scores(votes[:, :prefix], self.kernel_size, self.pooling, self.count_include_pad)
        return scores


@dataclass
class SnapKVPolicy(ObservationWindowScores):
    """SnapKV; equations, defaults and divergences in the module docstring."""

    name = "snapkv"
    summary = "observation-window attention votes, 1-D pooled, recent window kept (Li et al. 2024)"

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> torch.Tensor:
        n = layer.length
        budget = self.budget.per_head(n)
        protected = recent_window(n, self.effective_window(n, budget)).expand(layer.num_kv_heads, n)
        return keep_top(self.scores(layer), torch.full((layer.num_kv_heads,), budget), protected)

    def plan(self, request: RequestPrefill, layer_results: list[Any], state: dict[str, Any]) -> KeepPlan:
        return KeepPlan.from_mask(torch.stack(layer_results))
