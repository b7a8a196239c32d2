"""What a compression policy may ask the forward pass to record during a request's prefill.

Capture is opt-in per request: a request whose policy asks for nothing gets no capture object,
and the attention context then only passes tensors by reference (no copies, no statistics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_kvpress_ext.models.rope import RotaryEmbedding, apply_rope


@dataclass(frozen=True)
class ReconstructionSpec:
    """A context-reconstruction pass run after the prefill, before the keep plan (KVzip, `policies/kvzip.py`).

    The model is asked to repeat the cached prompt, `chunk_size` prompt tokens at a time; every cached
    entry gets the largest attention it receives from the queries that reconstruct its chunk (softmax
    over the first `sink_tokens` entries, the chunk's own cached entries and the reconstruction's own
    causal keys), maxed over the query heads of its GQA group. A chunk after the first quotes the last
    `overlap_tokens` tokens of the chunk before it, so the model knows where to resume. With `skip_header`
    (kvpress's `KVzipPress`), the prompt's first k tokens are left out of the pass, k the length of the chat
    template's text before a user message (its header, there): only the sinks among them are kept for sure,
    the rest score 0. Like kvpress, it does not check that the prompt opens with that header.
    """

    chunk_size: int = 2048
    sink_tokens: int = 4
    overlap_tokens: int = 8
    skip_header: bool = False


@dataclass(frozen=True)
class CaptureSpec:
    """`window`: how many of the last prefill positions' queries to keep (0 = none).
    `hidden_stats`: running mean / variance of each layer's attention-input hidden states.
    `keys_pre_rope`: every prefill token's pre-RoPE keys (for admission gates).
    `query_lse`: beside the window's queries, their log-sum-exps from the prefill's own attention
    (H2O's column sums start from them), where the attention path yields them.
    `query_moments`: per query head, the sum and the sum of outer products of every prefill token's
    query before RoPE (`[Hq, d]`, `[Hq, d, d]`): the mean and covariance of the queries (Expected
    Attention), at d*d per head instead of the hidden states' D*D.
    `leading_queries`: the first this-many positions' queries before RoPE, so a policy can take the
    moments without its sink tokens (their outlier activations would dominate them).
    `reconstruction`: run the context-reconstruction pass when the prefill completes and record each
    entry's score (`LayerCapture.reconstruction_scores`); the engine's model runner does this."""

    window: int = 0
    hidden_stats: bool = False
    keys_pre_rope: bool = False
    query_lse: bool = False
    query_moments: bool = False
    leading_queries: int = 0
    reconstruction: ReconstructionSpec | None = None

    @property
    def empty(self) -> bool:
        return (
            self.window == 0
            and not self.hidden_stats
            and not self.keys_pre_rope
            and not self.query_lse
            and not self.query_moments
            and self.leading_queries == 0
            and self.reconstruction is None
        )

    def computed_from(self, length: int) -> int:
        """The first prompt position a prefill compressed at `length` must compute itself for this capture.

        Positions before it may come from an exact cached prefix (`engine/prefix_store.py`): their keys and
        values are what any prefill of the same tokens writes. What the capture records of a position needs
        the prefill to run it: the window's queries (the last `window` positions before `length`), and, for
        statistics over every prompt token (hidden states, query moments, pre-RoPE keys), position 0.
        """
        if self.hidden_stats or self.keys_pre_rope or self.query_moments or self.leading_queries:
            return 0
        return max(0, length - self.window)

    def merge(self, other: CaptureSpec) -> CaptureSpec:
        return CaptureSpec(
            window=max(self.window, other.window),
            hidden_stats=self.hidden_stats or other.hidden_stats,
            keys_pre_rope=self.keys_pre_rope or other.keys_pre_rope,
            query_lse=self.query_lse or other.query_lse,
            query_moments=self.query_moments or other.query_moments,
            leading_queries=max(self.leading_queries, other.leading_queries),
            # Two different reconstructions cannot share one pass: the first wins, and a fork whose policy
            # wanted the other sees a spec that differs from its own (engine/prefix.py rejects it).
            reconstruction=self.reconstruction if self.reconstruction is not None else other.reconstruction,
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
    query_sum: torch.Tensor | None = None  # [Hq, d] float64, queries before RoPE
    query_outer_sum: torch.Tensor | None = None  # [Hq, d, d] float64
    query_count: int = 0
    leading_queries: torch.Tensor | None = None  # [s, Hq, d] the first positions' queries before RoPE
    keys_post_rope: list[torch.Tensor] = field(default_factory=list)
    # [Hkv, n] float32: each prompt entry's score from the context-reconstruction pass (`reconstruction`).
    reconstruction_scores: torch.Tensor | None = None
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

    def query_mean_cov(self, skip: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean `[Hq, d]` and population covariance `[Hq, d, d]` (float64) of the prefill queries before RoPE,
        over every position but the first `skip` (which must be at most the captured `leading_queries`)."""
        if self.query_sum is None or self.query_outer_sum is None:
            raise ValueError("query moments were not captured")
        total, outer, count = self.query_sum, self.query_outer_sum, self.query_count
        if skip:
            if self.leading_queries is None or self.leading_queries.shape[0] < skip:
                raise ValueError(f"the first {skip} queries were not captured")
            lead = self.leading_queries[:skip].double()
            total, outer = total - lead.sum(0), outer - torch.einsum("shi,shj->hij", lead, lead)
            count -= skip
        if count < 1:
            raise ValueError("no query left after the skipped positions")
        mean = total / count
        return mean, outer / count - mean.unsqueeze(-1) * mean.unsqueeze(-2)


# The records whose dimension `dim` runs over query heads (`PrefillCapture.join_query_heads`).
_QUERY_HEAD_FIELDS = (
    ("queries", 1),
    ("query_lse", 1),
    ("query_sum", 0),
    ("query_outer_sum", 0),
    ("leading_queries", 1),
)


class PrefillCapture:
    """Accumulates a request's per-layer captures across prefill chunks.

    `rotary` (the model's RoPE) is needed only for `query_moments` / `leading_queries`: the attention
    context hands over queries after RoPE, and the moments are of the queries before it.
    """

    def __init__(self, spec: CaptureSpec, num_layers: int, rotary: RotaryEmbedding | None = None) -> None:
        if (spec.query_moments or spec.leading_queries) and rotary is None:
            raise ValueError("capturing queries before RoPE needs the model's rotary embedding")
        self.spec = spec
        self.rotary = rotary
        self.layers = [LayerCapture() for _ in range(num_layers)]

    def record(
        self,
        layer: int,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor | None,
        k_pre_rope: torch.Tensor | None,
        lse: torch.Tensor | None = None,
    ) -> None:
        """One chunk of one layer; `lse` `[n, Hq]` when the chunk's attention yielded it. `hidden`, `k` and
        `k_pre_rope` may be None where the spec does not ask for them; a runner whose attention does not see
        the hidden states passes None and records them with `record_hidden`."""
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
        if spec.hidden_stats and hidden is not None:  # a runner without them here records them apart
            self.record_hidden(layer, hidden)
        if spec.keys_pre_rope:
            if k is None or k_pre_rope is None:
                raise ValueError("this capture needs the keys before and after RoPE")
            rec.keys_pre_rope.append(k_pre_rope.detach().clone())
            rec.keys_post_rope.append(k.detach().clone())
        if spec.query_moments or spec.leading_queries:
            self._record_queries(rec, positions, q)

    def record_hidden(self, layer: int, hidden: torch.Tensor) -> None:
        """One chunk's attention-input hidden states `[n, D]` of one layer, into its running statistics."""
        rec = self.layers[layer]
        h = hidden.detach().double()
        total, squares = h.sum(0), (h * h).sum(0)
        rec.hidden_sum = total if rec.hidden_sum is None else rec.hidden_sum + total
        rec.hidden_sq_sum = squares if rec.hidden_sq_sum is None else rec.hidden_sq_sum + squares
        rec.hidden_count += h.shape[0]

    def join_query_heads(self, join: Callable[[list[tuple[torch.Tensor, int]]], list[torch.Tensor]]) -> None:
        """Make every per-query-head record the whole query group's, where each KV head's group is split over the
        workers that hold it (tensor parallelism with more workers than KV heads: vLLM replicates each head, and
        gives each replica part of its query heads). `join` takes `(tensor, dim)` pairs, `dim` over this worker's
        query heads, and returns each joined with the other replicas' (`tensor_parallel.join_replicas`). The
        replicas' policies then see what one worker holding the whole group sees, and keep the same entries."""
        records = [
            (rec, name, dim)
            for rec in self.layers
            for name, dim in _QUERY_HEAD_FIELDS
            if getattr(rec, name) is not None
        ]
        joined = join([(getattr(rec, name), dim) for rec, name, dim in records])
        for (rec, name, _), tensor in zip(records, joined, strict=True):
            setattr(rec, name, tensor)

    def _record_queries(self, rec: LayerCapture, positions: torch.Tensor, q: torch.Tensor) -> None:
        assert self.rotary is not None
        cos, sin = self.rotary.cos_sin(positions)
        unrotated = apply_rope(q.detach().float(), cos, -sin)  # R(p)^-1 = R(-p): the query before RoPE
        if self.spec.query_moments:
            u = unrotated.double()
            total, outer = u.sum(0), torch.einsum("thi,thj->hij", u, u)
            rec.query_sum = total if rec.query_sum is None else rec.query_sum + total
            rec.query_outer_sum = outer if rec.query_outer_sum is None else rec.query_outer_sum + outer
            rec.query_count += u.shape[0]
        lead = unrotated[positions < self.spec.leading_queries]
        if lead.shape[0]:
            rec.leading_queries = lead if rec.leading_queries is None else torch.cat([rec.leading_queries, lead])
