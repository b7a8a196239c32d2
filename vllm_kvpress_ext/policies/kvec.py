"""`kvec`: coverage-driven eviction across heads and layers (K-VEC, Algorithm 1).

Paper: Roy, Zhai, Hajimirsadeghi and Samei, "Coverage-Driven KV Cache Eviction for Efficient and
Improved Inference of LLM" (arXiv 2606.29563, 2026). No public reference implementation was
available; the equations below follow the paper's Algorithm 1 as specified in the tracker.

Layers are processed in order (the engine calls `on_layer_prefilled` for layer 0, 1, ...). For
layer l with H KV heads, a prompt of n entries, mean budget B per (layer, KV head) and protected
window w = min(O, n, B) (see `policies/base.py`), the ranked entries are the prefix t < n - O:

    A[q, i, t] = softmax_t(q_i . k_t / sqrt(d))               query head q, causal by position
    P[h, t]    = GQA_h( mean_{i in last O queries} A[q, i, t] )    window mean, reduced per KV head
    sigma_h    = std_t P[h, t]                                  flatness of head h
    D          = the delta heads with the lowest sigma            (ties: lower head first)
    Pc[h, t]   = GQA_h( mean_{i in last O' queries} A[q, i, t] )  for h in D, else P[h, t]
                                                                  (cross-head coverage)
    I[t]       = mean_{i in last O queries} max_q A[q, i, t]    global importance
    cov[t]     = n_t / (l + 1)                                  n_t = earlier layers keeping t in >= 1 head
    focus[t]   = I[t] * (1 - cov[t])
    P'[h, t]   = Pc[h, t] + lambda * focus[t]                   (cross-layer coverage)
    F          = min(floor(beta * B), B - w)                    forced entries per head
    forced_h   = top_F(P[h])                                    by the original P
    keep_h     = window  U  forced_h  U  top_{B - w - F}(P'[h] outside forced_h)
    n_t       += 1  for every t kept by at least one head of layer l

So every head keeps exactly B entries (n when the prompt is no longer than B). With lambda = 0 and
delta = 0, P' = P and the forced entries are P's own top, so the selection is SnapKV's with an
observation window O (and the same pooling). `unique_token_coverage` measures what the coverage
modules buy: the fraction of prompt tokens that survive in at least one (layer, head).

Defaults (the paper's): O = 16, O' = 32, delta = 3, lambda = 1.0, beta = 0.25; no pooling
(kernel_size 1: Algorithm 1 ranks raw window means; SnapKV's pooling is one field away and, when
on, pools P and Pc along tokens before anything else). Budget default: ratio 0.25, the
project-wide default of the SnapKV family. GQA: mean over a KV head's query heads, the SnapKV
family's convention here.

Divergences and interpretations:
- "Original P" for the forced entries is the O-window P, before both coverage modules (so a
  low-sigma head keeps its own top-F by the short window and fills the rest by the extended one).
- sigma_h and every ranking are over the prefix (the protected window is not ranked, as in SnapKV).
- l is 0-based, so cov = n_t / (l + 1) is 0 for layer 0 and below 1 afterwards.
- "Max over heads" in I[t] is over the layer's query heads (the attention heads), before any GQA
  reduction; P and Pc are per KV head (`gqa_reduction`), so each KV head keeps one set of pages.
- n_t is keyed by token position and lives in the request's `state`; the engine keeps one state
  per request, so concurrent requests never mix coverage counts.
- The forced count is floor(beta * B) with B the per-head budget (window included, the project's
  budget unit), capped at the B - w selectable slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvpress_ext.attention import ops
from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.policies.base import (
    LayerPrefill,
    PolicyConfigError,
    RequestPrefill,
    captured_window_attention,
    captured_window_votes,
    keep_top,
    own_heads,
    pool_scores,
    recent_window,
    reduce_group,
)
from vllm_kvpress_ext.policies.capture import CaptureSpec
from vllm_kvpress_ext.policies.snapkv import ObservationWindowScores

STATE_KEY = "kvec_layer_hits"


def _last_queries(layer: LayerPrefill, num_queries: int) -> int:
    """How many captured queries the last `num_queries` are (fewer if fewer were captured, at least one)."""
    capture = layer.capture
    assert capture is not None and capture.queries is not None
    return max(1, min(num_queries, capture.queries.shape[0]))


def window_probs(layer: LayerPrefill, num_queries: int) -> torch.Tensor:
    """Attention `[Hq, q, n]` of the last `num_queries` captured queries (shared by forks of one prefix)."""
    return captured_window_attention(layer, _last_queries(layer, num_queries))


def window_means(layer: LayerPrefill, num_queries: int, how: str) -> torch.Tensor:
    """Window-mean attention per KV head `[Hkv, n]` (GQA reduced by `how`) through `attention.ops`."""
    return captured_window_votes(layer, _last_queries(layer, num_queries), "mean", how)


def unique_token_coverage(keep: torch.Tensor | KeepPlan, length: int | None = None) -> float:
    """Fraction of the prompt's tokens kept by at least one (layer, head).

    `keep` is a bool mask `[L, H, n]` or a keep plan (then `length`, the prompt length, is needed).
    """
    if isinstance(keep, KeepPlan):
        if length is None:
            raise ValueError("unique_token_coverage needs the prompt length with a KeepPlan")
        valid = keep.indices[keep.indices >= 0]
        covered = torch.zeros(length, dtype=torch.bool)
        covered[valid] = True
        return float(covered.float().mean()) if length else 1.0
    if keep.shape[-1] == 0:
        return 1.0
    return float(keep.reshape(-1, keep.shape[-1]).any(dim=0).float().mean())


def head_coverage(keep: torch.Tensor) -> float:
    """Mean over layers of the fraction of tokens kept by at least one head of that layer (`keep[L, H, n]`)."""
    if keep.shape[-1] == 0:
        return 1.0
    return float(keep.any(dim=1).float().mean())


@dataclass
class KVECPolicy(ObservationWindowScores):
    """K-VEC; equations, defaults and divergences in the module docstring."""

    name = "kvec"
    decides_across_layers = True  # its coverage counts what every layer before keeps
    summary = "coverage-driven eviction: cross-head extended windows and cross-layer focus (Roy et al. 2026)"

    window: int = 16
    kernel_size: int = 1
    extended_window: int = 32
    delta: int = 3
    lam: float = 1.0
    beta: float = 0.25

    def validate(self) -> None:
        super().validate()
        if self.window < 1:
            raise PolicyConfigError(f"window (the observation window O) must be >= 1, got {self.window}")
        if self.extended_window < self.window:
            raise PolicyConfigError(
                f"extended_window (O') must be >= window (O) = {self.window}, got {self.extended_window}"
            )
        if self.delta < 0:
            raise PolicyConfigError(f"delta (heads given the extended window) must be >= 0, got {self.delta}")
        if self.lam < 0:
            raise PolicyConfigError(f"lam (cross-layer focus weight lambda) must be >= 0, got {self.lam}")
        if not 0.0 <= self.beta <= 1.0:
            raise PolicyConfigError(f"beta (forced fraction of the budget) must lie in [0, 1], got {self.beta}")

    def capture_spec(self) -> CaptureSpec:
        return CaptureSpec(window=max(self.window, self.extended_window if self.delta > 0 else 0))

    def _head_scores(self, means: torch.Tensor, prefix: int) -> torch.Tensor:
        """Window-mean attention per KV head (`[H, n]`) of the prefix entries, pooled: `[H, prefix]`."""
        return pool_scores(means[:, :prefix], self.kernel_size, self.pooling, self.count_include_pad)

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> torch.Tensor:
        n, heads = layer.length, layer.num_kv_heads
        positions = layer.positions.cpu().long()
        hits: torch.Tensor = state.get(STATE_KEY, torch.zeros(0))
        size = int(positions.max()) + 1 if n else 0
        if hits.numel() < size:
            hits = torch.cat([hits, torch.zeros(size - hits.numel())])
        budget = self.budget.per_head(n)
        window = self.effective_window(n, budget)
        selectable = budget - window
        if budget >= n or selectable == 0:
            # Nothing to rank: the whole prompt, or the window (shrunk to the budget), is what stays.
            keep = recent_window(n, n if budget >= n else window).expand(heads, n).contiguous()
        else:
            keep = self._select(layer, hits[positions], budget, window)
        # Coverage counts a position kept by any head of the layer: every tensor-parallel worker's heads.
        covered = layer.all_heads(keep).any(dim=0)
        state[STATE_KEY] = hits.index_add(0, positions, covered.float())
        return keep

    def _select(self, layer: LayerPrefill, hits: torch.Tensor, budget: int, window: int) -> torch.Tensor:
        n, heads = layer.length, layer.num_kv_heads
        prefix = n - window  # here window == self.window < n (budget > window and budget < n)
        probs: torch.Tensor | None = None
        extended_probs: torch.Tensor | None = None
        delta = min(self.delta, layer.total_kv_heads)
        if ops.backend(layer.keys) == "reference":
            # One probability tensor serves P, P over O' and I (the max over query heads needs it anyway):
            # the window's queries are the extended window's last ones, each query's softmax is its own, and
            # reducing it is what `window_votes` would compute.
            if delta > 0:
                extended_probs = window_probs(layer, self.extended_window)  # [Hq, O', n]
                probs = extended_probs[:, -_last_queries(layer, self.window) :]
            else:
                probs = window_probs(layer, self.window)  # [Hq, O, n]
            means = reduce_group(probs.mean(dim=1), heads, self.gqa_reduction)
        else:  # the kernel reduces without materialising the probabilities
            means = window_means(layer, self.window, self.gqa_reduction)
        scores = self._head_scores(means, prefix)  # P [H, prefix]
        cross_head = scores.clone()  # Pc
        if delta > 0:
            # The delta flattest heads of the layer, among every tensor-parallel worker's; then this worker's of them.
            sigma = layer.all_heads(scores.std(dim=-1, unbiased=False))
            flattest = torch.zeros(sigma.shape[0], dtype=torch.bool)
            flattest[torch.sort(sigma, stable=True).indices[:delta]] = True
            low = own_heads(layer.shard, flattest).to(scores.device)
            if extended_probs is not None:
                extended_means = reduce_group(extended_probs.mean(dim=1), heads, self.gqa_reduction)
            else:
                extended_means = window_means(layer, self.extended_window, self.gqa_reduction)
            extended = self._head_scores(extended_means, prefix)
            cross_head[low] = extended[low]
        if probs is None and self.lam > 0:
            probs = window_probs(layer, self.window)
        if probs is None:  # lambda = 0: the focus term vanishes
            importance = torch.zeros(prefix, device=scores.device)
        else:
            # I [prefix]: the max over the layer's query heads, every tensor-parallel worker's.
            peak = layer.all_heads(probs[:, :, :prefix].amax(dim=0, keepdim=True)).amax(dim=0)
            importance = peak.mean(dim=0)
        coverage = hits[:prefix].to(importance.device) / (layer.layer + 1)
        adjusted = cross_head + self.lam * (importance * (1.0 - coverage))  # P'
        forced_count = min(int(self.beta * budget), budget - window)
        no_protection = torch.zeros(heads, prefix, dtype=torch.bool)
        forced = keep_top(scores, torch.full((heads,), forced_count), no_protection)
        protected = torch.cat([forced, torch.ones(heads, window, dtype=torch.bool)], dim=-1)
        ranked = torch.cat([adjusted.cpu().float(), torch.zeros(heads, window)], dim=-1)
        return keep_top(ranked, torch.full((heads,), budget), protected)

    def plan(self, request: RequestPrefill, layer_results: list[Any], state: dict[str, Any]) -> KeepPlan:
        return KeepPlan.from_mask(torch.stack(layer_results))
