"""`h2o`: heavy hitters by accumulated attention, plus the most recent tokens, bounded during decode.

Paper: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models" (NeurIPS 2023). Reference implementation: `H2OKVCache_LayerWise` in
`h2o_hf/utils_real_drop/modify_llama.py` of the authors' H2O repository (the "real drop" variant,
which physically removes entries as this project does).

Equations, per (layer, KV head), with B entries kept per head, of which r = round(B * recent_fraction)
are the most recent tokens and B - r are heavy hitters:

    prefill:  A[i, j] = softmax_j(q_i . k_j / sqrt(d))     causal, i over ALL prompt queries
              s[j]    = sum_i A[i, j]                       accumulated attention (column sums)
              keep    = recent_r  U  top_{B - r}(s)          heavy hitters among the older entries
    decode:   after each step t (its token already in the cache),
              s[j]   += A[t, j]                             for every held entry j (the new one too)
              while a head holds more than B entries:
                  evict argmin { s[j] : j not among its r most recent positions }

Scores live in the request's `state`, keyed by token position (decode-time eviction moves entries
inside the cache, so indices are not stable; positions travel with the entries). Per decode step
the cost is one sort over each head's entries to re-align them, which stays O(B log B) per head.

Prefill scores need every prompt query. By default (`observation_window: null`) the policy asks
the forward pass to capture all prompt queries ([n, Hq, d] per layer, i.e. G times the size of the
keys, held until the plan is made) with their log-sum-exps, which the prefill's own attention
yields for free where it runs torch's CPU flash attention or the chunked path (`query_lse`), and
computes the column sums exactly without materialising the n x n attention (`causal_column_sums`:
with the log-sum-exps known, A[i, j] = exp(s_ij - lse_i) needs no softmax, and a C++ CPU kernel sums
it down the columns): O(n^2 Hq d) work per layer, about half of the prefill's own attention. Setting
`observation_window: W` scores with the last W queries only (SnapKV-style, no pooling): O(W n)
work and W queries captured, a cheaper approximation of the paper's sums.

Defaults: ratio 0.2 with recent_fraction 0.5, i.e. the paper's main setting of a 20% cache split
into 10% heavy hitters and 10% recent tokens (`--heavy_ratio 0.1 --recent_ratio 0.1` in the
reference scripts); gqa_reduction mean.

Budget during decode: with `tokens`, the cap is `tokens` (a prompt shorter than that is kept whole
and the cache grows up to the cap); with `ratio`, the cap is fixed at prefill to round(ratio * n)
for the n prompt tokens present at compression (the reference likewise fixes its cache size from
the prompt length).

Divergences:
- GQA: the paper's models are multi-head; here each KV head's scores reduce its query heads'
  attention by `gqa_reduction` (mean by default, which ranks like the group's summed attention),
  so each KV head keeps one set of entries.
- The reference splits the budget as two separate ratios of the prompt length; here a single
  budget (`ratio` or `tokens`, see `policies/base.py`) is split by `recent_fraction`.
- Ties in scores evict the older position first (the reference leaves ties to `topk`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvpress_ext.attention import cpu_kernels
from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.policies.base import (
    GQA_REDUCTIONS,
    Budget,
    DecodeEviction,
    DecodeStep,
    KVPolicy,
    LayerPrefill,
    PolicyConfigError,
    RequestPrefill,
    check_choice,
    keep_top,
    recent_window,
    shared_prefix_score,
)
from vllm_kvpress_ext.policies.capture import CaptureSpec
from vllm_kvpress_ext.policies.streaming_llm import evictions, most_recent

ALL_QUERIES = 1 << 62  # capture window meaning "every prompt query"
BLOCK_ELEMENTS = 1 << 24  # attention probabilities materialised at once while scoring a prefill


def accumulated_attention(layer: LayerPrefill, window: int | None, how: str) -> torch.Tensor:
    """Column sums `[Hkv, n]` of the causal attention of the captured queries (all, or the last `window`).

    The whole prompt's queries over its own keys (the default; positions 0..n-1 on both sides) go to
    `causal_column_sums`, which never materialises more than a tile of the n x n probabilities. A
    window, or positions of any other shape, go to `dense_column_sums` (bounded query blocks).
    Requests forked from one prefix compute this once (`LayerCapture.shared`).
    """
    key = ("h2o.accumulated_attention", window, how, layer.length, layer.scale)
    # A copy: the caller accumulates decode attention into what it gets.
    return shared_prefix_score(layer, key, lambda: _column_sums(layer, window, how)).clone()


def _column_sums(layer: LayerPrefill, window: int | None, how: str) -> torch.Tensor:
    capture = layer.capture
    assert capture is not None and capture.queries is not None and capture.query_positions is not None
    queries, qpos = capture.queries, capture.query_positions
    if window is not None:
        queries, qpos = queries[-window:], qpos[-window:]
    key_positions = layer.positions.to(layer.keys.device)
    prompt = torch.arange(layer.length, device=key_positions.device)
    if window is None and torch.equal(key_positions, prompt) and torch.equal(qpos.to(prompt.device), prompt):
        total = causal_column_sums(queries, layer.keys, layer.scale, capture.query_lse)
    else:
        total = dense_column_sums(queries, qpos, layer.keys, key_positions, layer.scale)
    return (total.mean(dim=1) if how == "mean" else total.amax(dim=1)).cpu()


def dense_column_sums(
    queries: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor, key_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Column sums `[Hkv, G, n]` per query head, by query blocks of at most `BLOCK_ELEMENTS` probabilities.

    queries `[m, Hq, d]` at `query_positions[m]`, keys `[Hkv, n, d]` at `key_positions[n]`; causal by
    position. Keys are read per KV head (no per-block copy for the query heads of a group).
    """
    heads, n = keys.shape[0], keys.shape[1]
    group = queries.shape[1] // heads
    keys = keys.float()
    block = max(1, BLOCK_ELEMENTS // max(1, queries.shape[1] * n))
    total = torch.zeros(heads, group, n, dtype=torch.float32, device=keys.device)
    for start in range(0, queries.shape[0], block):
        q = queries[start : start + block].float().to(keys.device)
        q = q.view(q.shape[0], heads, group, -1)  # [b, Hkv, G, d]
        logits = torch.einsum("bhgd,hnd->hgbn", q, keys) * scale
        causal = key_positions.view(1, -1) <= query_positions[start : start + block].to(keys.device).view(-1, 1)
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        total += probs.sum(dim=2)
    return total


def causal_column_sums(
    queries: torch.Tensor, keys: torch.Tensor, scale: float, lse: torch.Tensor | None = None
) -> torch.Tensor:
    """Column sums `[Hkv, G, n]` of a prompt's causal attention: query i (position i) over keys 0..i.

    With A[i, j] = exp(s_ij - lse_i), the column sum is sum over i >= j of exp(s_ij - lse_i). Given
    each query's log-sum-exp (`lse` `[n, Hq]`, natural log: the prefill's own attention yields it,
    `CaptureSpec.query_lse`), that is one pass of dot products and exponentials with no softmax left
    to compute; without it, one fused causal attention pass gets it first. On a CPU the pass is the
    C++ kernel (`attention/cpu_kernels.py`): the QK^T dot products and one exp per logit, about half
    of an attention pass. Where that kernel cannot be built, torch's flash attention does it: the
    log-sum-exp of the transposed problem (key j queries the prompt's queries i >= j, each biased by
    -lse_i), reversed so that "i >= j" is causal, with the bias carried in one extra head dimension;
    that costs a whole attention pass, as it also multiplies by values nobody needs. Off the CPU,
    `tiled_column_sums` does the sums by query tiles over their visible keys. Every path equals
    `dense_column_sums` up to float rounding (the same plans; tests/test_policies_baselines.py).
    """
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is None or keys.device.type != "cpu":
        return tiled_column_sums(queries, keys, scale)
    heads, n = keys.shape[0], keys.shape[1]
    num_q_heads = queries.shape[1]
    group = num_q_heads // heads
    q = queries.float().transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, n, d]
    if lse is None:
        k_heads = keys.float().unsqueeze(0).contiguous()  # [1, Hkv, n, d]: the op broadcasts over the group
        lse = flash(q, k_heads, torch.zeros_like(k_heads), 0.0, True, scale=scale)[1][0].transpose(0, 1)
    sums = cpu_kernels.causal_column_sums_given_lse(queries, keys, lse, scale)
    if sums is not None:
        return sums
    k = keys.float().repeat_interleave(group, dim=0).unsqueeze(0).contiguous()  # [1, Hq, n, d]
    bias = (-lse.float().transpose(0, 1) / scale).unsqueeze(0)  # [1, Hq, n]
    # Reversed and transposed: the keys query the queries, each query carrying its -lse in one more dimension.
    as_queries = torch.cat([k.flip(2), torch.ones(1, num_q_heads, n, 1)], dim=-1)
    as_keys = torch.cat([q.flip(2), bias.flip(-1).unsqueeze(-1)], dim=-1)
    _, column_lse = flash(as_queries, as_keys, torch.zeros_like(as_keys), 0.0, True, scale=scale)[:2]
    return column_lse.flip(-1).exp().view(heads, group, n)


def tiled_column_sums(queries: torch.Tensor, keys: torch.Tensor, scale: float, tile: int = 512) -> torch.Tensor:
    """`causal_column_sums` by query tiles: each tile of queries over the keys it can see (0..its last position).

    Never more than `tile` x n probabilities per query head at once, and about half the work of
    `dense_column_sums` (no key past a tile's last query is scored).
    """
    heads, n, dim = keys.shape
    group = queries.shape[1] // heads
    keys = keys.float()
    q = (queries.float().to(keys.device) * scale).view(n, heads, group, dim).permute(1, 2, 0, 3)  # [Hkv, G, n, d]
    total = torch.zeros(heads, group, n, dtype=torch.float32, device=keys.device)
    future = torch.ones(tile, tile, dtype=torch.bool, device=keys.device).triu(1)
    for start in range(0, n, tile):
        end = min(n, start + tile)
        logits = torch.matmul(q[:, :, start:end], keys[:, None, :end].transpose(-1, -2))  # [Hkv, G, b, end]
        logits[..., start:end].masked_fill_(future[: end - start, : end - start], float("-inf"))
        total[..., :end] += torch.softmax(logits, dim=-1).sum(dim=2)
    return total


def reduce_decode_attention(attention: torch.Tensor, how: str) -> torch.Tensor:
    """`[Hkv, G, N]` (raw per query head) or `[Hkv, N]` (already reduced) -> `[Hkv, N]` fp32."""
    attention = attention.float()
    if attention.dim() == 2:
        return attention
    if how == "mean":
        return attention.mean(dim=1)
    return attention.amax(dim=1)


def realign(old_positions: torch.Tensor, old_scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Scores of `positions[..., N]` looked up by position in (`old_positions`, `old_scores`)[..., M]; 0 if absent."""
    if old_positions.shape[-1] == 0:
        return torch.zeros(positions.shape, dtype=torch.float32)
    missing = torch.iinfo(torch.int64).max
    keys = old_positions.masked_fill(old_positions < 0, missing)
    sorted_keys, order = torch.sort(keys, dim=-1)
    sorted_scores = old_scores.gather(-1, order)
    index = torch.searchsorted(sorted_keys, positions.contiguous()).clamp(max=sorted_keys.shape[-1] - 1)
    found = (sorted_keys.gather(-1, index) == positions) & (positions >= 0)
    return torch.where(found, sorted_scores.gather(-1, index), torch.zeros_like(sorted_scores.gather(-1, index)))


@dataclass
class H2OPolicy(KVPolicy):
    """H2O; equations, defaults and divergences in the module docstring."""

    name = "h2o"
    summary = "heavy hitters by accumulated attention + recent tokens, bounded during decode (Zhang et al. 2023)"

    ratio: float | None = 0.2
    tokens: int | None = None
    recent_fraction: float = 0.5
    observation_window: int | None = None
    gqa_reduction: str = "mean"

    @property
    def budget(self) -> Budget:
        return Budget(ratio=self.ratio, tokens=self.tokens)

    def validate(self) -> None:
        if not 0.0 <= self.recent_fraction <= 1.0:
            raise PolicyConfigError(
                f"recent_fraction (share of the budget given to recent tokens) must lie in [0, 1], "
                f"got {self.recent_fraction}"
            )
        if self.observation_window is not None and self.observation_window < 1:
            raise PolicyConfigError(
                f"observation_window must be >= 1, or null for every prompt query, got {self.observation_window}"
            )
        check_choice("gqa_reduction", self.gqa_reduction, GQA_REDUCTIONS)
        self.budget.validate()

    def capture_spec(self) -> CaptureSpec:
        if self.observation_window is None:
            return CaptureSpec(window=ALL_QUERIES, query_lse=True)
        return CaptureSpec(window=self.observation_window)

    @property
    def wants_decode_steps(self) -> bool:
        return True

    @property
    def wants_decode_attention(self) -> bool:
        return True

    def cap(self, length: int) -> int:
        """Entries per head kept from now on, for a request compressed with `length` prompt entries."""
        return self.budget.decode_cap(length)

    def recent(self, cap: int) -> int:
        return min(cap, round(cap * self.recent_fraction))

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        n, heads = layer.length, layer.num_kv_heads
        cap = self.cap(n)
        state["cap"] = cap
        scores = accumulated_attention(layer, self.observation_window, self.gqa_reduction)
        protected = recent_window(n, self.recent(cap)).expand(heads, n)
        keep = keep_top(scores, torch.full((heads,), min(cap, n)), protected)
        positions = layer.positions.cpu().to(torch.int64).view(1, -1).expand(heads, n)
        return {"keep": keep, "positions": positions.masked_fill(~keep, -1), "scores": scores}

    def plan(self, request: RequestPrefill, layer_results: list[Any], state: dict[str, Any]) -> KeepPlan:
        state["positions"] = torch.stack([r["positions"] for r in layer_results])  # [L, H, n], -1 = dropped
        state["scores"] = torch.stack([r["scores"] for r in layer_results])
        return KeepPlan.from_mask(torch.stack([r["keep"] for r in layer_results]))

    def on_decode_step(self, step: DecodeStep, state: dict[str, Any]) -> DecodeEviction | None:
        cap = int(state["cap"])
        positions = torch.stack([layer.positions for layer in step.layers]).to(torch.int64)  # [L, H, N]
        lengths = torch.stack([layer.lengths for layer in step.layers]).to(torch.int64)  # [L, H]
        valid = positions >= 0
        width = positions.shape[-1]
        attention = torch.zeros(positions.shape, dtype=torch.float32)
        for index, layer in enumerate(step.layers):
            if layer.attention is None:
                raise RuntimeError("h2o needs each decode step's attention; the engine passed none")
            probs = reduce_decode_attention(layer.attention.cpu(), self.gqa_reduction)[:, :width]
            attention[index, :, : probs.shape[-1]] = probs
        scores = realign(state["positions"], state["scores"], positions) + attention.masked_fill(~valid, 0.0)
        excess = (lengths - cap).clamp(min=0)  # [L, H]
        drop = torch.zeros_like(valid)
        if bool((excess > 0).any()):
            candidates = valid & ~most_recent(positions, self.recent(cap))
            # Evict the lowest scores first; ties evict the older position first.
            by_position = torch.sort(positions.masked_fill(~valid, torch.iinfo(torch.int64).max), dim=-1).indices
            ranked = scores.gather(-1, by_position).masked_fill(~candidates.gather(-1, by_position), float("inf"))
            order = by_position.gather(-1, torch.sort(ranked, dim=-1, stable=True).indices)
            rank = torch.empty_like(order)
            rank.scatter_(-1, order, torch.arange(width).expand_as(order).contiguous())
            drop = candidates & (rank < excess.unsqueeze(-1))
        kept = valid & ~drop
        state["positions"] = positions.masked_fill(~kept, -1)
        state["scores"] = scores.masked_fill(~kept, 0.0)
        return evictions(drop)
