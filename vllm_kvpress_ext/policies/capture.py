"""What a compression policy may ask the forward pass to record during a request's prefill.

Capture is opt-in per request: a request whose policy asks for nothing gets no capture object,
and the attention context then only passes tensors by reference (no copies, no statistics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class CaptureSpec:
    """`window`: how many of the last prefill positions' queries to keep (0 = none).
    `hidden_stats`: running mean / variance of each layer's attention-input hidden states.
    `keys_pre_rope`: every prefill token's pre-RoPE keys (for admission gates).
    `query_lse`: beside the window's queries, their log-sum-exps from the prefill's own attention
    (H2O's column sums start from them), where the attention path yields them."""

    window: int = 0
    hidden_stats: bool = False
    keys_pre_rope: bool = False
    query_lse: bool = False

    @property
    def empty(self) -> bool:
        return self.window == 0 and not self.hidden_stats and not self.keys_pre_rope and not self.query_lse

    def merge(self, other: CaptureSpec) -> CaptureSpec:
        return CaptureSpec(
            window=max(self.window, other.window),
            hidden_stats=self.hidden_stats or other.hidden_stats,
            keys_pre_rope=self.keys_pre_rope or other.keys_pre_rope,
            query_lse=self.query_lse or other.query_lse,
        )


@dataclass
class LayerCapture:
    """Per-layer record of one request's prefill."""

    queries: torch.Tensor | None = None  # [w, Hq, d] post-RoPE queries of the last w positions
    query_positions: torch.Tensor | None = None  # [w]
    # [w, Hq] float32 natural-log log-sum-exp of each captured query's attention; None when not asked for,
    # or when some chunk's attention path did not yield it (`lse_missing`, sticky for the request).
    query_lse: torch.Tensor | None = None
    lse_missing: bool = False
    hidden_sum: torch.Tensor | None = None  # [D] float64
    hidden_sq_sum: torch.Tensor | None = None  # [D] float64
    hidden_count: int = 0
    keys_pre_rope: list[torch.Tensor] = field(default_factory=list)  # chunks of [n, Hkv, d]
    keys_post_rope: list[torch.Tensor] = field(default_factory=list)
    # Scores computed from this layer's prefill alone, keyed by what computed them. Requests forked from one
    # prefilled prefix (engine/prefix.py) share the dict: their captures and uncompressed keys are the same,
    # so a score one of them computed (e.g. H2O's all-query attention, O(n^2)) serves the others. None: unshared.
    shared: dict[Any, torch.Tensor] | None = None

    @property
    def hidden_mean(self) -> torch.Tensor:
        if self.hidden_sum is None or self.hidden_count == 0:
            raise ValueError("hidden-state statistics were not captured")
        return self.hidden_sum / self.hidden_count

    @property
    def hidden_var(self) -> torch.Tensor:
        """Population variance over the prefill tokens."""
        if self.hidden_sq_sum is None or self.hidden_count == 0:
            raise ValueError("hidden-state statistics were not captured")
        mean = self.hidden_mean
        return (self.hidden_sq_sum / self.hidden_count - mean * mean).clamp(min=0.0)


class PrefillCapture:
    """Accumulates a request's per-layer captures across prefill chunks."""

    def __init__(self, spec: CaptureSpec, num_layers: int) -> None:
        self.spec = spec
        self.layers = [LayerCapture() for _ in range(num_layers)]

    def record(
        self,
        layer: int,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        k_pre_rope: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """One chunk of one layer; `lse` `[n, Hq]` when the chunk's attention yielded it."""
        rec = self.layers[layer]
        spec = self.spec
        if spec.window:
            queries = q.detach() if rec.queries is None else torch.cat([rec.queries, q.detach()])
            qpos = positions if rec.query_positions is None else torch.cat([rec.query_positions, positions])
            rec.queries, rec.query_positions = queries[-spec.window :].clone(), qpos[-spec.window :].clone()
            if spec.query_lse:
                if lse is None or rec.lse_missing:
                    rec.lse_missing, rec.query_lse = True, None
                else:
                    lses = lse.detach() if rec.query_lse is None else torch.cat([rec.query_lse, lse.detach()])
                    rec.query_lse = lses[-spec.window :].float().clone()
        if spec.hidden_stats:
            h = hidden.detach().double()
            s, sq = h.sum(0), (h * h).sum(0)
            rec.hidden_sum = s if rec.hidden_sum is None else rec.hidden_sum + s
            rec.hidden_sq_sum = sq if rec.hidden_sq_sum is None else rec.hidden_sq_sum + sq
            rec.hidden_count += h.shape[0]
        if spec.keys_pre_rope:
            rec.keys_pre_rope.append(k_pre_rope.detach().clone())
            rec.keys_post_rope.append(k.detach().clone())
