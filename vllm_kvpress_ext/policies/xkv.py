"""`xkv`: personalized per-layer cache sizes by a provably optimal greedy allocation.

Paper: Li, Wang, Gu, Yu, "XKV: Personalized KV Cache Memory Reduction for Long-Context LLM
Inference" (arXiv 2412.05896, 2024): Algorithm 1 (allocation) and Algorithm 2 (eviction).

Equations, for a prompt of n entries, L layers, an observation window of the last w = min(ows, n)
queries and the P = n - w earlier entries:

    score vector   a_l[h, j] = (1/w) sum_{i in window} softmax_j(q_i[h] . k_j / sqrt(d))    j < P
                   w_l[j]    = pool_k( mean_h a_l[h, .] )[j]             mean over all query heads
                   (pool_k: `pooling` of size `kernel_size`, avgpool_7 by default; `gqa_reduction` and
                   `pooling` also shape each KV head's own selection scores, never w_l's head mean)
    coverage       R_l(m)    = Sum(Top-m(w_l)) / Sum(w_l)                 share of layer l's mass kept
    objective      R_avg(m_1..m_L) = (1/L) sum_l R_l(m_l)
    Algorithm 1    given N:   maximise R_avg subject to sum_l m_l = N, 0 <= m_l <= P
                   given R*:  the smallest N whose optimum reaches R_avg >= R*
    Algorithm 2    layer l:   each KV head keeps the window plus its own top m_l entries

Greedy solution (Algorithm 1): sort every layer's w_l / Sum(w_l) in decreasing order and merge
the L lists; the first N merged values, counted per layer, are the allocation. R_l is concave in
m (its increments are the sorted, non-increasing values), so the objective is a separable concave
sum under one cardinality constraint, for which taking the N largest increments is optimal (an
exchange argument: any other allocation trades a larger increment for a smaller one). For the
target mode, the optimum R_avg(N) is non-decreasing in N and equals the cumulative sum of the
merged values / L, so the minimal N is found by one search over that cumulative sum (up to float64
rounding). Ties go to the lower layer.

Heads inside a layer share its size: every KV head of layer l keeps the window plus m_l entries,
chosen by that head's own pooled scores (its query heads' attention reduced by `gqa_reduction`,
the SnapKV scoring of `snapkv.py`). The allocation uses the head-averaged w_l, as the paper's
per-layer vector does; per-head selection keeps each head's own heavy entries at the same count.

Budgets, exactly one of (none given: `ratio` 0.25, the SnapKV family's default):
- `ratio` / `tokens` (base semantics, window included, see `policies/base.py`): B entries per
  (layer, KV head) on average, so N = L (B - w) entries are allocated; the mean over layers of
  the kept entries per head is B exactly. A ratio budget below the window keeps the last B entries.
- `target_ratio` R* in (0, 1]: the per-request minimal N reaching R_avg >= R* (memory then
  differs per request: XKV's "personalized" mode).
- `profile` (a YAML file written by `XKVProfile.save`, e.g. by `kvpress profile xkv`): per-layer
  kept fractions f_l measured offline; with no budget each layer keeps m_l = round(f_l P), with
  `ratio`/`tokens` the total L (B - w) is shared in proportion to f_l (capped at P per layer, exact
  integer total). So with no budget the profile also fixes the memory: a prompt of n entries keeps
  about w + (sum_l f_l / L) P entries per (layer, KV head) on average (each m_l is rounded); with
  a budget only the proportions f_l / sum_l f_l matter.

Profiling (`profile_xkv` in `bench/xkv_profile.py`, which runs the engine, and the command
`kvpress profile xkv`): sampled prompts run once each in the `target_ratio` mode; f_l is the mean
over those requests of m_l / P (requests with P = 0 skipped), so each f_l lies in [0, 1] and
sum_l f_l / L is the mean share of the ranked prefix they kept. Only the measurement lives there:
this module stays free of the engine, which imports the policies.

Defaults: ows = 8 (`window`) and average pooling of size 7 (`kernel_size`, `pooling`), the
paper's settings, with the zero padding at both ends counted in the average (`count_include_pad`,
PyTorch's and the SnapKV reference's default; see `pool_scores` in `policies/base.py`);
`gqa_reduction` mean (the project's SnapKV-family default).

Divergences:
- The paper profiles the allocation offline (a mini, sampled inference on a light model variant)
  and compresses layer by layer during prefill. Here the allocation is computed per request from
  the request's own window attention once prefill completes (the engine's `plan` hook), which is
  the same Algorithm 1 on exact rather than sampled scores. The offline mode exists too: `kvpress
  profile xkv` runs sampled prompts of the synthetic suite (training seeds) through the full model,
  not a lighter variant, and saves the mean allocation. A saved `profile` is applied layer by layer
  during prefill, as in the paper (below).
- GQA: per-head selection under the shared per-layer count (the paper does not treat heads).
- The pooled vector is normalised by its own sum (pooling changes the mass slightly).

Models with sliding-window layers (Gemma 3): the paper's layers are all global. Here a sliding layer's
ring holds its window and is no layer of the allocation: Algorithm 1 spreads the budget over the global
layers only (L in the equations is their count), and a saved profile is the global layers' allocation.
Such a model compresses at the end of prefill, never layer by layer (the rings never hold a prompt).

Layer-wise prefill compression: with a saved `profile` the per-layer sizes m_l depend only on the
prompt length, so they are known before the prompt runs and layer l's keep set (its heads' own top
m_l + window) needs nothing from later layers. The policy then opts in (`compresses_layerwise`):
the engine compresses each layer right after its prefill, as the paper does, and the prefill peak
is one layer's full prompt KV plus the compressed earlier layers instead of every layer's full KV.
The kept entries are exactly those of end-of-prefill compression (same scores, same m_l). Without a
profile the allocation (Algorithm 1) ranks every layer's scores together, so compression waits for
the last layer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import yaml

from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.policies.base import (
    Budget,
    LayerKeep,
    LayerPrefill,
    PolicyConfigError,
    RequestPrefill,
    keep_top,
    pool_scores,
    recent_window,
)
from vllm_kvpress_ext.policies.snapkv import ObservationWindowScores

DEFAULT_RATIO = 0.25

# ----------------------------------------------------------------------------- Algorithm 1


def _normalised_sorted(coverage: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each layer's score vector divided by its sum (uniform when the sum is 0), sorted decreasing, float64."""
    out = []
    for w in coverage:
        v = w.detach().double().cpu().clamp(min=0.0).reshape(-1)
        total = float(v.sum())
        v = v / total if total > 0 else torch.full_like(v, 1.0 / max(1, v.numel()))
        out.append(torch.sort(v, descending=True).values)
    return out


def _merged(coverage: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """All layers' normalised sorted values merged in decreasing order (ties: lower layer), and their layers."""
    values = _normalised_sorted(coverage)
    flat = torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)
    layers = torch.cat([torch.full((v.numel(),), i, dtype=torch.int64) for i, v in enumerate(values)])
    order = torch.sort(flat, descending=True, stable=True).indices
    return flat[order], layers[order]


def coverage_ratio(coverage: Sequence[torch.Tensor], allocation: Sequence[int]) -> float:
    """R_avg = (1/L) sum_l Sum(Top-m_l(w_l)) / Sum(w_l)."""
    values = _normalised_sorted(coverage)
    return sum(float(v[:m].sum()) for v, m in zip(values, allocation, strict=True)) / max(1, len(values))


def greedy_allocation(coverage: Sequence[torch.Tensor], total: int) -> list[int]:
    """The allocation {m_l} with sum m_l = min(total, sum_l |w_l|) that maximises R_avg (optimal)."""
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    _, layers = _merged(coverage)
    return torch.bincount(layers[:total], minlength=len(coverage)).tolist()


def allocation_for_target(coverage: Sequence[torch.Tensor], target: float) -> list[int]:
    """The allocation of the smallest total N whose optimal R_avg reaches `target` (all entries if none does)."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must lie in (0, 1], got {target}")
    values, layers = _merged(coverage)
    reached = values.cumsum(0) / max(1, len(coverage))
    total = min(int((reached < target).sum()) + 1, values.numel())
    return torch.bincount(layers[:total], minlength=len(coverage)).tolist()


# ----------------------------------------------------------------------------- profiles


def allocation_from_fractions(fractions: Sequence[float], capacity: int, total: int | None = None) -> list[int]:
    """Per-layer sizes from profiled kept fractions f_l, each in [0, capacity].

    `total` None: m_l = round(f_l * capacity) (halves up). Otherwise exactly min(total, L * capacity)
    entries shared in proportion to f_l (water-filling at the cap, then largest remainders, ties to
    the lower layer); layers the profile left empty only receive what the others cannot hold.
    """
    num_layers = len(fractions)
    weights = [Fraction(max(0.0, float(f))) for f in fractions]
    if total is None:
        return [min(capacity, math.floor(w * capacity + Fraction(1, 2))) for w in weights]
    goal = min(max(0, total), num_layers * capacity)
    remaining = Fraction(goal)
    ideal = [Fraction(0)] * num_layers
    profiled = [i for i in range(num_layers) if weights[i] > 0]
    unprofiled = [i for i in range(num_layers) if weights[i] == 0]
    # Profiled layers first, in proportion to f_l; what they cannot hold goes evenly to the others.
    for free, share in ((profiled, weights), (unprofiled, [Fraction(1)] * num_layers)):
        while free and remaining > 0:
            scale = remaining / sum(share[i] for i in free)
            full = [i for i in free if scale * share[i] >= capacity]
            if not full:
                for i in free:
                    ideal[i] = scale * share[i]
                remaining = Fraction(0)
                break
            for i in full:
                ideal[i] = Fraction(capacity)
                remaining -= capacity
            free = [i for i in free if i not in full]
    sizes = [math.floor(x) for x in ideal]
    deficit = goal - sum(sizes)
    for i in sorted(range(num_layers), key=lambda i: (-(ideal[i] - sizes[i]), i)):
        if deficit <= 0:
            break
        if sizes[i] < capacity:
            sizes[i] += 1
            deficit -= 1
    return sizes


@dataclass
class XKVProfile:
    """Per-layer kept fractions f_l (entries kept / entries scored, window excluded) and how they were measured."""

    fractions: list[float]
    window: int = 8
    kernel_size: int = 7
    pooling: str = "avgpool"
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.fractions)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": "xkv",
            "num_layers": self.num_layers,
            "fractions": [float(f) for f in self.fractions],
            "window": self.window,
            "kernel_size": self.kernel_size,
            "pooling": self.pooling,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "profile") -> XKVProfile:
        if not isinstance(data, dict) or data.get("policy") != "xkv":
            raise PolicyConfigError(f"{source} is not an XKV profile (a mapping with `policy: xkv` and `fractions`)")
        fractions = data.get("fractions")
        if (
            not isinstance(fractions, list)
            or not fractions
            or not all(isinstance(f, int | float) and not isinstance(f, bool) and 0 <= f <= 1 for f in fractions)
        ):
            raise PolicyConfigError(f"{source}: `fractions` must be a non-empty list of numbers in [0, 1]")
        if data.get("num_layers", len(fractions)) != len(fractions):
            raise PolicyConfigError(f"{source}: num_layers does not match its {len(fractions)} fractions")
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise PolicyConfigError(f"{source}: `metadata` must be a mapping")
        return cls(
            fractions=[float(f) for f in fractions],
            window=int(data.get("window", 8)),
            kernel_size=int(data.get("kernel_size", 7)),
            pooling=str(data.get("pooling", "avgpool")),
            metadata=metadata,
        )

    def save(self, path: str | Path) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        header = "# XKV profile: per-layer kept fractions (see vllm_kvpress_ext/policies/xkv.py)\n"
        out.write_text(header + yaml.safe_dump(self.to_dict(), sort_keys=False))
        return out

    @classmethod
    def load(cls, path: str | Path) -> XKVProfile:
        p = Path(path)
        if not p.is_file():
            raise PolicyConfigError(f"XKV profile {p} does not exist")
        cached = _load_profile(str(p.resolve()), p.stat().st_mtime_ns)
        return cls(list(cached.fractions), cached.window, cached.kernel_size, cached.pooling, dict(cached.metadata))

    @classmethod
    def from_allocations(
        cls, allocations: Sequence[Sequence[int]], capacities: Sequence[int], **settings: Any
    ) -> XKVProfile:
        """Mean kept fraction m_l / P per layer over profiled requests (requests with P = 0 are skipped)."""
        rows = [[m / p for m in alloc] for alloc, p in zip(allocations, capacities, strict=True) if p > 0]
        if not rows:
            raise ValueError("no profiled request had entries to score (every prompt was within the window)")
        fractions = [sum(col) / len(rows) for col in zip(*rows, strict=True)]
        metadata = dict(settings.pop("metadata", {}))
        metadata.setdefault("requests", len(rows))
        return cls(fractions=fractions, metadata=metadata, **settings)


@functools.lru_cache(maxsize=32)
def _load_profile(path: str, mtime_ns: int) -> XKVProfile:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        # The parser's message quotes the offending line: never repeat a file's contents in an error.
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise PolicyConfigError(f"XKV profile {path} is not valid YAML{where}") from None
    return XKVProfile.from_dict(data, source=path)


# ----------------------------------------------------------------------------- the policy


@dataclass
class XKVLayerScores:
    """`scores[Hkv, n]`: per-head pooled window votes (for selection); `coverage[P]`: the layer's w_l."""

    scores: torch.Tensor
    coverage: torch.Tensor


@dataclass
class XKVPolicy(ObservationWindowScores):
    """XKV; equations, budgets, defaults and divergences in the module docstring."""

    name = "xkv"
    decides_across_layers = True  # its allocation shares one budget among the layers
    summary = "per-layer sizes by an optimal greedy allocation of window-attention coverage (Li et al. 2024)"

    ratio: float | None = None
    tokens: int | None = None
    window: int = 8
    kernel_size: int = 7
    pooling: str = "avgpool"
    target_ratio: float | None = None
    profile: str | None = None

    file_fields = ("profile",)

    @property
    def budget(self) -> Budget:
        """The `ratio`/`tokens` budget (the default ratio when neither is given)."""
        if self.ratio is None and self.tokens is None:
            return Budget(ratio=DEFAULT_RATIO)
        return Budget(ratio=self.ratio, tokens=self.tokens)

    def validate(self) -> None:
        given = [k for k in ("ratio", "tokens", "target_ratio") if getattr(self, k) is not None]
        if len(given) > 1:
            raise PolicyConfigError(
                f"give at most one budget: `ratio`, `tokens` or `target_ratio` (R_avg target); got {', '.join(given)}"
            )
        super().validate()
        if self.target_ratio is not None:
            if not 0.0 < self.target_ratio <= 1.0:
                raise PolicyConfigError(f"target_ratio (R_avg target) must lie in (0, 1], got {self.target_ratio}")
            if self.profile is not None:
                raise PolicyConfigError("a `profile` fixes the per-layer fractions: give it no `target_ratio`")
        if self.profile is not None:
            self.load_profile()

    def load_profile(self) -> XKVProfile | None:
        return None if self.profile is None else XKVProfile.load(self.profile)

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> XKVLayerScores:
        n = layer.length
        prefix = n - min(self.window, n)
        if prefix == 0:  # nothing before the window: nothing to rank
            return XKVLayerScores(torch.zeros(layer.num_kv_heads, n), torch.zeros(0, dtype=torch.float64))
        query_votes = self.query_votes(layer)
        scores = self.scores(layer, query_votes).cpu()
        # w_l pools the mean over all query heads, whatever reduction and pooling select inside a head:
        # with `max` or `maxpool` the mean of the heads' selection scores would be another vector.
        # Under tensor parallelism, every worker's query heads: w_l must be the same on all of them.
        mean_votes = layer.all_heads(query_votes[:, :prefix].float()).mean(dim=0, keepdim=True)
        coverage = pool_scores(mean_votes, self.kernel_size, self.pooling, self.count_include_pad)[0]
        return XKVLayerScores(scores, coverage.cpu().double())

    def allocation(self, coverage: list[torch.Tensor], length: int) -> tuple[list[int], int]:
        """(m_l per layer, protected window) for a prompt of `length` entries: Algorithm 1 in the chosen mode."""
        num_layers = len(coverage)
        fixed = self.score_free_allocation(num_layers, length)
        if fixed is not None:
            return fixed
        window = min(self.window, length)
        if self.target_ratio is not None:
            return allocation_for_target(coverage, self.target_ratio), window
        return greedy_allocation(coverage, num_layers * (self.budget.per_head(length) - window)), window

    def score_free_allocation(self, num_layers: int, length: int) -> tuple[list[int], int] | None:
        """(m_l, window) when no score enters it, else None (Algorithm 1 must rank every layer's scores).

        Score-free: a prompt within the window, a saved profile, a budget that keeps everything or
        only a shrunk window. A profile always lands here, which is what makes layer-wise prefill
        compression possible.
        """
        window = min(self.window, length)
        prefix = length - window
        if prefix == 0:
            # Nothing to rank. A `ratio` / `tokens` budget still holds (base semantics: a ratio is honoured
            # on a prompt shorter than the window): the last B entries stay. The budget-free modes keep all.
            budget_free = self.target_ratio is not None or (
                self.profile is not None and self.ratio is None and self.tokens is None
            )
            return [0] * num_layers, length if budget_free else min(length, self.budget.per_head(length))
        if self.target_ratio is not None:
            return None
        profile = self.load_profile()
        if profile is not None and profile.num_layers != num_layers:
            raise ValueError(f"XKV profile {self.profile} has {profile.num_layers} layers, the model {num_layers}")
        if profile is not None and self.ratio is None and self.tokens is None:
            return allocation_from_fractions(profile.fractions, prefix), window
        budget = self.budget.per_head(length)
        if budget >= length:
            return [prefix] * num_layers, window
        effective = self.effective_window(length, budget)
        if effective < window:  # a ratio budget below the window: the window shrinks to it
            return [0] * num_layers, effective
        if profile is not None:
            return allocation_from_fractions(profile.fractions, prefix, num_layers * (budget - window)), window
        return None

    @staticmethod
    def _layer_mask(result: XKVLayerScores, size: int, window: int, length: int) -> torch.Tensor:
        """Algorithm 2 for one layer: each KV head keeps the window plus its own top `size` entries, `[Hkv, n]`."""
        heads = result.scores.shape[0]
        protected = recent_window(length, window).expand(heads, length)
        return keep_top(result.scores, torch.full((heads,), size + window), protected)

    def plan(self, request: RequestPrefill, layer_results: list[Any], state: dict[str, Any]) -> KeepPlan:
        results: list[XKVLayerScores] = layer_results
        n = request.length
        coverage = [r.coverage for r in results]
        sizes, window = self.allocation(coverage, n)
        self._note_allocation(state, coverage, sizes, n)
        return KeepPlan.from_mask(
            torch.stack([self._layer_mask(r, m, window, n) for r, m in zip(results, sizes, strict=True)])
        )

    def _note_allocation(
        self, state: dict[str, Any], coverage: list[torch.Tensor], sizes: list[int], length: int
    ) -> None:
        """The request's allocation, capacity P and coverage R_avg, in the request state."""
        state["allocation"] = sizes
        state["capacity"] = length - min(self.window, length)
        state["r_avg"] = coverage_ratio(coverage, sizes) if state["capacity"] else 1.0

    @property
    def compresses_layerwise(self) -> bool:
        """With a saved profile the sizes depend only on the prompt length: compress each layer after its prefill."""
        return self.profile is not None

    def prefill_peak_pages(self, length: int, num_layers: int, num_kv_heads: int, page_size: int) -> int:
        """With a profile, exact: while layer l is prefilled, layers < l hold m_m + window entries per head.

        Every head of layer m keeps exactly min(n, m_m + window) entries (`_layer_mask`), known from the
        prompt length alone; the peak is while the last layer holds its whole prompt.
        """
        full = super().prefill_peak_pages(length, num_layers, num_kv_heads, page_size)
        fixed = self.score_free_allocation(num_layers, length) if self.compresses_layerwise else None
        if fixed is None:
            return full
        sizes, window = fixed
        per_layer = [num_kv_heads * -(-min(length, m + window) // page_size) for m in sizes]
        whole = num_kv_heads * -(-length // page_size)
        peak = max(sum(per_layer[:layer]) + whole for layer in range(num_layers))
        return min(full, max(peak, sum(per_layer)))

    def plan_layer(
        self, request: RequestPrefill, layer: int, layer_results: list[Any], state: dict[str, Any]
    ) -> LayerKeep:
        """Layer `layer`'s keep mask, the same one `plan` would give it (the profile fixes every m_l up front)."""
        n = request.length
        fixed = self.score_free_allocation(request.num_layers, n)
        assert fixed is not None, "layer-wise XKV needs a profile"
        sizes, window = fixed
        if layer == request.num_layers - 1:
            self._note_allocation(state, [r.coverage for r in layer_results], sizes, n)
        return LayerKeep([layer], self._layer_mask(layer_results[layer], sizes[layer], window, n).unsqueeze(0))
