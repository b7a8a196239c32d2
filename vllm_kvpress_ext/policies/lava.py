"""`lava`: attention x value-norm scores, dynamic head budgets and entropy-driven layer budgets.

Paper: Shen, Yuan, Zhang, Wang, Jiang and Nguyen, "LAVa: Layer-wise KV Cache Eviction with Dynamic
Budget Allocation" (arXiv 2509.09754, 2025). Reference implementation: `LavaKVCluster` in
`adaptive_snapkv/monkeypatch/snapkv_utils.py` and the layer loop of
`adaptive_mistral_hijack_lava.py` in the authors' repository (MGDDestiny/Lava).

Equations, for L layers of H KV heads, a prompt of n entries, mean budget B per (layer, KV head)
and protected window w (as resolved by `Budget` and `effective_window`, see `policies/base.py`);
the ranked entries are the prefix i < n - w:

    A[q, j, i]  = softmax_i(q_j . k_i / sqrt(d))                 query head q, causal
    s[l, q, i]  = (max_k ||V[l, h(q), k]||_1 / w) * sum_{j in last w queries} A[q, j, i]
    s[l, h, i]  = max_{q in group h} pool1d(s[l, q, .])[i]        GQA: max over the group (max pooling, k = 7)
    keep        = window  U  top_{T_l} { s[l, h, i] : h, i }       one top-k over the flattened layer:
                                                                    heads get what they win (dynamic head budgets)
    p[l, h, i]  = s[l, h, i] / sum_{h, i} s[l, h, i]
    e_l         = -sum_{h, i} p log p / log(H (n - w))            normalised entropy of layer l
    T           = L H (B - w)                                     selectable entries of the request
    T_l         = e_l / sum_m e_m * T                              dynamic layer budgets (flatter layer -> more)
    B_l         = T_l + H w                                        entries kept by layer l (sum over its heads)

T_l is capped at H (n - w) (a layer cannot keep more than it holds; the excess is re-shared among the
other layers in proportion to e, so sum_l B_l = L H B exactly) and rounded to integers by largest
remainder (ties to the lower layer). The max over k of the value norm runs over the ranked prefix, as
in the reference. A prompt no longer than B is kept whole; when the budget is below the window (a
ratio budget) each head keeps its last B entries.

Cascading form (the paper's prefill schedule): as layer l finishes prefill, the layers seen so far
share T in proportion to their entropies, T_m(l) = e_m / sum_{m' <= l} e_m' * T (capped), and
earlier layers are re-compressed to these shrinking budgets, so the prefill never holds much more
than T + L H w + H n entries instead of L H n. `cascade_schedule` gives each step's budgets (rounded
up at intermediate steps so they never grow back; the last step is exactly the one-shot T_l), and
`prefill_peak_entries` the peak of both forms; the schedule and that peak are recorded in the request
state under `"lava"` in both forms.

`cascading: true` makes the pool follow the cascade: the policy opts in to layer-wise prefill
compression (`compresses_layerwise`), and during the last prefill chunk's forward pass the engine
compresses layer l right after its attention and re-compresses layers 0..l-1 whose budget shrank
(`plan_layer`), before layer l + 1 allocates its pages. The measured prefill peak is then about the
cascade's, not L H n entries. With `cascading: false` (the default) compression waits for the end of
prefill and the cascade is only computed.

Kept sets: a cascading form may keep different entries than the one-shot form, because entries dropped
at an early step cannot come back; it keeps the same ones only if every re-plan of a layer is a subset
of its previous one. Here that holds, so the final kept sets equal the one-shot plan's: each layer is
scored once, on its full prompt KV before anything of it is dropped (later steps reuse those scores),
the flattened top-k of the same scores with a smaller count is a prefix of the same ranking, and the
budgets never grow (intermediate steps round up, the last is the one-shot allocation). A variant that
re-scored compressed layers, or rounded intermediate budgets down, would end with other (smaller) sets;
the engine refuses any re-plan that is not a subset rather than silently keep less.

Models with sliding-window layers (Gemma 3): the paper scores every layer. Here a sliding layer's ring
holds its window and takes no part: the entropies, the layer budgets (L H B in all) and the cascade run
over the global layers only, L being their count, and the prompt never compresses layer by layer.

Defaults, from the reference's LongBench configs (`c*_w32_k7_maxpool.json` with `--gqa_support`):
window 32, kernel 7, max pooling, GQA max. Budget default: ratio 0.25, the project-wide default of the
SnapKV family.

Divergences:
- Floor: the reference gives each head round((1 - alpha) c_h + F) entries, with c_h its share of
  the flattened top-k, alpha = 0.2 (`--floor_alpha`) and F = int(alpha * base_capacity) computed once
  from the configured budget (its layer loop writes the rescaled floor to a misspelt attribute,
  `floor_capactiy`, so F never follows the dynamic layer budget). Heads' budgets then sum to
  (1 - alpha) T_l + H F rather than T_l. The paper has no floor: heads get exactly what they win in
  the flattened top-k, which is what is implemented (per-layer head budgets sum to B_l).
- Layer budgets: the reference truncates each e_l / sum(e) * T with int() and caps nothing (a layer
  whose share exceeds its prompt silently wastes it); here the shares are capped, re-shared and
  rounded so the total is exactly L H B.
- The reference's optional `normalize` reweighting, its `skip` (uniform budgets for the first layers)
  and its `pyram_mode` are not implemented (all off in its LongBench runs).
- Budget is `ratio` or `tokens` per (layer, KV head), window included, like the SnapKV family; the
  window shrinks to the budget when a ratio budget is smaller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.policies.base import (
    LayerKeep,
    LayerPrefill,
    RequestPrefill,
    captured_window_votes,
    pages_bound,
    pool_scores,
    recent_window,
    reduce_group,
)
from vllm_kvpress_ext.policies.snapkv import ObservationWindowScores

STATE_KEY = "lava"


def normalized_entropy(scores: torch.Tensor) -> float:
    """Entropy of `scores` (any shape, non-negative) normalised to a distribution, divided by log(count).

    1 for uniform scores, 0 for a single non-zero entry; 1 when there is at most one entry or no mass.
    """
    flat = scores.reshape(-1).double().clamp(min=0.0)
    total = float(flat.sum())
    if flat.numel() <= 1 or total <= 0.0:
        return 1.0
    p = flat / total
    entropy = -float(torch.special.xlogy(p, p).sum())
    return min(1.0, max(0.0, entropy / math.log(flat.numel())))


def _water_fill(weights: list[Fraction], members: list[int], total: Fraction, cap: int, shares: list[Fraction]) -> None:
    """Share `total` among `members` in proportion to `weights`, none above `cap` (capped excess re-shared)."""
    remaining, free = total, [i for i in members if weights[i] > 0]
    while free and remaining > 0:
        level = remaining / sum(weights[i] for i in free)
        over = [i for i in free if level * weights[i] >= cap]
        if not over:
            for i in free:
                shares[i] = level * weights[i]
            return
        for i in over:
            shares[i] = Fraction(cap)
            remaining -= cap
        free = [i for i in free if i not in over]


def _shares(weights: list[float], total: int, cap: int) -> list[Fraction]:
    """Real shares of `total` (<= cap * len) proportional to `weights`, each at most `cap`.

    Zero-weight entries get nothing unless the others are all capped; then they share the rest evenly.
    """
    count = len(weights)
    exact = [Fraction(max(0.0, x)) for x in weights]
    shares = [Fraction(0)] * count
    _water_fill(exact, list(range(count)), Fraction(total), cap, shares)
    leftover = Fraction(total) - sum(shares)
    if leftover > 0:
        idle = [i for i in range(count) if exact[i] == 0]
        _water_fill([Fraction(1)] * count, idle, leftover, cap, shares)
    return shares


def layer_budgets(entropies: list[float], total: int, cap: int) -> list[int]:
    """Selectable entries per layer: `total` shared in proportion to `entropies`, each <= `cap`, summing to `total`.

    `total` is L H (B - w); `cap` is H (n - w). Largest-remainder rounding, ties to the lower layer.
    """
    if not 0 <= total <= cap * len(entropies):
        raise ValueError(f"total {total} must lie in [0, {cap} * {len(entropies)}]")
    shares = _shares(entropies, total, cap)
    floors = [math.floor(s) for s in shares]
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - floors[i]), i))
    for i in order[: total - sum(floors)]:
        floors[i] += 1
    return floors


def cascade_step(entropies: list[float], total: int, cap: int, num_layers: int) -> list[int]:
    """Selectable budgets of layers 0..l once layer l = len(entropies) - 1 has finished prefill (cascading form).

    The layers seen so far share `total` in proportion to their entropies (capped). Intermediate steps
    round up, so a layer's budget never grows from one step to the next (dropped entries cannot come
    back: as the sum of entropies grows, every capped proportional share shrinks); the last step
    (l = num_layers - 1) is exactly `layer_budgets`.
    """
    if len(entropies) == num_layers:
        return layer_budgets(entropies, total, cap)
    shares = _shares(entropies, min(total, cap * len(entropies)), cap)
    return [min(cap, math.ceil(s)) for s in shares]


def cascade_schedule(entropies: list[float], total: int, cap: int) -> list[list[int]]:
    """Every step of the cascade: step l lists the budgets of layers 0..l (see `cascade_step`)."""
    return [cascade_step(entropies[: last + 1], total, cap, len(entropies)) for last in range(len(entropies))]


def prefill_peak_entries(schedule: list[list[int]], heads: int, length: int, window: int) -> dict[str, int]:
    """Peak entries held during prefill: one-shot (every layer whole) vs cascading (`schedule`).

    In the cascading form, while layer l is prefilled it holds all n entries per head and layers
    0..l-1 hold their step-(l-1) budgets plus their windows.
    """
    num_layers = len(schedule)
    full = heads * length
    cascading = 0
    for layer in range(num_layers):
        earlier = sum(b + heads * window for b in schedule[layer - 1]) if layer else 0
        cascading = max(cascading, earlier + full)
    final = sum(b + heads * window for b in schedule[-1]) if schedule else 0
    return {"one_shot": num_layers * full, "cascading": max(cascading, final)}


def flattened_keep(scores: torch.Tensor, protected: torch.Tensor, count: int) -> torch.Tensor:
    """Keep mask `[H, n]`: the protected entries plus the `count` best others over all heads at once.

    Ties break towards lower heads, then lower indices.
    """
    heads, n = scores.shape
    free = scores.cpu().float().masked_fill(protected.cpu(), float("-inf")).reshape(-1)
    order = torch.sort(free, descending=True, stable=True).indices[:count]
    chosen = torch.zeros(heads * n, dtype=torch.bool)
    chosen[order] = True
    return protected.cpu() | chosen.view(heads, n)


@dataclass
class LavaPolicy(ObservationWindowScores):
    """LAVa; equations, defaults and divergences in the module docstring."""

    name = "lava"
    decides_across_layers = True  # its layer budgets come from every layer's entropy
    summary = "attention x value-norm scores, flattened head budgets, entropy layer budgets (Shen et al. 2025)"

    kernel_size: int = 7
    pooling: str = "maxpool"
    gqa_reduction: str = "max"
    cascading: bool = False

    def lava_scores(self, layer: LayerPrefill, prefix: int) -> torch.Tensor:
        """s[h, i] of the `prefix` ranked entries, `[H, prefix]` (see the module docstring)."""
        capture = layer.capture
        assert capture is not None and capture.queries is not None and capture.query_positions is not None
        w = max(1, min(self.window, capture.queries.shape[0]))
        value_norm = layer.values[:, :prefix].float().abs().sum(dim=-1).amax(dim=-1)  # [Hkv]
        if self.gqa_reduction == "max" and (self.pooling == "maxpool" or self.kernel_size <= 1):
            # Max over the group commutes with max-pooling and with the positive per-KV-head scale, exactly,
            # so the group can be reduced first, inside `window_votes` (the kernel on CUDA, [Hkv, n] only).
            votes = captured_window_votes(layer, w, "sum", "max")
            pooled = pool_scores(votes[:, :prefix], self.kernel_size, self.pooling, self.count_include_pad)
            return pooled * (value_norm.to(pooled.device) / w).unsqueeze(-1)
        # Otherwise pool and scale per query head first, as the equations order it.
        per_query = captured_window_votes(layer, w, "sum", None)  # [Hq, n]
        votes = pool_scores(per_query[:, :prefix], self.kernel_size, self.pooling, self.count_include_pad)
        group = votes.shape[0] // layer.num_kv_heads
        scaled = votes * (value_norm.to(votes.device) / w).repeat_interleave(group).unsqueeze(-1)
        return reduce_group(scaled, layer.num_kv_heads, self.gqa_reduction)

    def _shape(self, length: int) -> tuple[int, int, bool]:
        """(budget per head, protected window, whether anything is ranked) for a prompt of `length` entries."""
        budget = self.budget.per_head(length)
        window = self.effective_window(length, budget)
        return budget, window, window < budget < length

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> torch.Tensor:
        """Scores of the layer; also advances the cascade (budgets of layers 0..l after layer l's prefill)."""
        n, heads = layer.length, layer.total_kv_heads
        budget, window, ranked = self._shape(n)
        record = state.setdefault(STATE_KEY, {"entropies": [], "cascade": []})
        if not ranked:
            return torch.zeros(heads, 0)  # the whole prompt, or the window shrunk to the budget, stays
        # Entropies and the flattened top-k run over every head of the layer, on every tensor-parallel worker.
        scores = layer.all_heads(self.lava_scores(layer, n - window).cpu())
        record["entropies"].append(normalized_entropy(scores))
        total, cap = layer.num_layers * heads * (budget - window), heads * (n - window)
        record["cascade"].append(cascade_step(record["entropies"], total, cap, layer.num_layers))
        return scores

    def plan(self, request: RequestPrefill, layer_results: list[Any], state: dict[str, Any]) -> KeepPlan:
        num_layers, heads, n = len(layer_results), request.num_kv_heads, request.length
        budget, window, ranked = self._shape(n)
        record = state.setdefault(STATE_KEY, {"entropies": [], "cascade": []})
        if not ranked:
            keep = recent_window(n, n if budget >= n else window)
            record["layer_budgets"] = [heads * min(n, budget)] * num_layers
            return KeepPlan.from_mask(keep.expand(num_layers, heads, n).contiguous())
        selectable = record["cascade"][-1]  # the last cascade step is the one-shot allocation
        masks = [
            self._layer_keep(scores, count, n, window) for scores, count in zip(layer_results, selectable, strict=True)
        ]
        self._note_final(record, heads, n, window)
        return KeepPlan.from_mask(torch.stack(masks))

    @staticmethod
    def _layer_keep(scores: torch.Tensor, count: int, length: int, window: int) -> torch.Tensor:
        """Keep mask `[H, n]` of one layer: the window plus the `count` best ranked entries over all heads."""
        heads = scores.shape[0]
        protected = recent_window(length, window).expand(heads, length)
        return flattened_keep(torch.cat([scores, torch.zeros(heads, window)], dim=-1), protected, count)

    @staticmethod
    def _note_final(record: dict[str, Any], heads: int, length: int, window: int) -> None:
        record["layer_budgets"] = [count + heads * window for count in record["cascade"][-1]]
        record["prefill_peak_entries"] = prefill_peak_entries(record["cascade"], heads, length, window)

    @property
    def compresses_layerwise(self) -> bool:
        """The cascading form compresses (and re-compresses) layers during the last prefill chunk."""
        return self.cascading

    def prefill_peak_pages(self, length: int, num_layers: int, num_kv_heads: int, page_size: int) -> int:
        """Cascading form: a bound valid for any entropies (they are only known once each layer is scored).

        While layer l is prefilled (all n entries per head), layers 0..l-1 hold their step-(l-1) budgets,
        which share at most min(T, l * cap) selectable entries (T = L H (B - w), cap = H (n - w)) plus one
        per layer from rounding the intermediate steps up (`cascade_step`), and their windows, l H w.
        How those entries split over the l H (layer, head) page lists is score-dependent, so their pages
        are bounded by `pages_bound`. Without ranking (the budget keeps everything, or only the window)
        every head keeps the same count and the bound is exact.
        """
        full = super().prefill_peak_pages(length, num_layers, num_kv_heads, page_size)
        if not self.cascading:
            return full
        heads, n = num_kv_heads, length
        budget, window, ranked = self._shape(n)
        whole = heads * -(-n // page_size)
        if not ranked:
            kept = heads * -(-(n if budget >= n else window) // page_size)
            return min(full, max(kept * (num_layers - 1) + whole, kept * num_layers))
        total, cap = num_layers * heads * (budget - window), heads * (n - window)
        peak = whole
        for layer in range(1, num_layers):
            earlier = min(total, layer * cap) + layer + layer * heads * window
            peak = max(peak, pages_bound(earlier, layer * heads, page_size, n) + whole)
        final = pages_bound(total + num_layers * heads * window, num_layers * heads, page_size, n)
        return min(full, max(peak, final))

    def plan_layer(
        self, request: RequestPrefill, layer: int, layer_results: list[Any], state: dict[str, Any]
    ) -> LayerKeep:
        """Cascade step `layer`: the new layer at its budget, and the earlier layers whose budget shrank.

        Masks are over each layer's prompt entries (see `LayerKeep`) and only ever shrink a layer
        (see the module docstring), so after the last layer every layer holds its one-shot B_l.
        """
        num_layers, heads, n = request.num_layers, request.num_kv_heads, request.length
        budget, window, ranked = self._shape(n)
        record = state.setdefault(STATE_KEY, {"entropies": [], "cascade": []})
        if not ranked:
            if layer == num_layers - 1:
                record["layer_budgets"] = [heads * min(n, budget)] * num_layers
            keep = recent_window(n, n if budget >= n else window)
            return LayerKeep([layer], keep.expand(1, heads, n).contiguous())
        cascade = record["cascade"]
        step = cascade[layer]
        previous = cascade[layer - 1] if layer else []
        layers = [m for m in range(layer) if step[m] != previous[m]] + [layer]
        masks = torch.stack([self._layer_keep(layer_results[m], step[m], n, window) for m in layers])
        if layer == num_layers - 1:
            self._note_final(record, heads, n, window)
        return LayerKeep(layers, masks)
