"""`gvote`: per-request, budget-free keep sets voted by synthetic future queries.

Paper: Tang, Liu, Xu, Huang, "GVote: Adaptive Per-request KV-Cache Compression without Manually
Setting Budget" (arXiv 2509.03136, 2025), Algorithm 1.

Equations, per layer, for a prompt of n entries with keys K (post-RoPE, as cached), Hq query heads
in groups of G per KV head, the prefill's last position p and the layer's attention-input hidden
states x_1..x_n (after input_layernorm):

    step budget     A_0[h]   = softmax(q_p[h] . K_{g(h)}^T / sqrt(d))       real query of position p
                    B[h]     = min { k : top-k mass of A_0[h] >= p_nuc }      top-p nucleus size, >= 1
    Gaussian fit    mu, s^2  = per-channel mean and (population) variance of x_1..x_n
    samples         h_s      = mu + s * eps_s,  eps_s ~ N(0, I),  s = 1..S    (seeded, see below)
    synthetic q     u_s      = q_norm(W_q h_s + b_q)                          the layer's own q path
                    c, t     = mean over f = 1..n_f of cos / sin of position p + f
                    q_s      = u_s * c + rotate_half(u_s) * t                 RoPE, averaged angles
    votes           V_s[h]   = top-B[h] keys of q_s[h] . K_{g(h)}^T
    keep set        keep[g]  = U_{s=1..S} U_{h in group g} V_s[h]             per KV head g

The budget is |keep[g]|, whatever the union is: no ratio or token count is set. A request whose
last query attends sharply (small B) and whose hidden states vary little (samples agree) keeps
few entries; a diffuse, varied one keeps many, so memory differs per request, layer and head.

The default divergence: `--kv-policy gvote` keeps the paper's claim (a per-request budget chosen
without a manual setting) but not its placement. The votes above size the request's memory, their
total sum_{l, g} |keep[l, g]|; AdaKV chooses the entries within it (`allocation` = "request", below).
On SmolLM2-135M Algorithm 1 answers none of the served needle tasks at the memory its votes choose,
and this variant answers what AdaKV answers at that memory (docs/gvote.md). Algorithm 1 exactly is
one field away: `allocation: votes` (`configs/variants/gvote-algorithm1.yaml`).

Defaults: p_nuc = 0.95 and S = 8 (the paper's recommended setting: nucleus threshold 0.95 and at
least 8 samples). The rest are this project's choices, the paper fixing no value we could cite:
- `future_positions` n_f = 32: the synthetic queries stand for the next n_f decode positions. The
  mean of a rotation over n_f consecutive positions shrinks the RoPE pairs whose period is shorter
  than about n_f tokens (fine-grained position) and keeps the phase of the slower pairs, so the
  queries carry the coarse "where" of the answer but not one exact position. 32 covers a short
  answer; long generations may want more.
- `window` = 0 and `sink_tokens` = 0: Algorithm 1 protects no recent window and no sinks; both are
  available (the last `window` entries and the first `sink_tokens` entries are added to the union).
- `seed` = 0: layer l draws eps_1..eps_S from `torch.Generator().manual_seed(seed * 65537 + l)`,
  one `torch.randn(D, dtype=float64)` per sample in order, on the CPU (the same numbers on every
  device). So a request's plan is reproducible (a preempted request recomputes the same cache),
  and sample s does not depend on S, which makes keep sets grow monotonically with S.

Observed queries (`observation_window` w, default 0 = Algorithm 1 exactly): the last w real prompt
queries also vote, each with its own nucleus over the keys it could see,

    observed        O_i[h]   = min-size set of keys of KV head g(h) visible to position p_i whose
                               softmax(q_{p_i}[h] . K^T / sqrt(d)) mass reaches p_nuc,  i = 1..w
    keep set        keep[g] |= U_i U_{h in group g} O_i[h]

This is a divergence, off by default, measured on SmolLM2-135M with `kvpress bench recall`
(docs/gvote.md). There Algorithm 1 answers none of the served needle tasks: its synthetic queries,
drawn from the whole prompt's hidden-state statistics, stand for an average context token and not for
the question, and in the middle layers (9-20) the last query's nucleus is 1-20 entries for most heads
(the sink and a few recent tokens hold its mass), so those layers keep 2-12% of the prompt. On one
2,048-token pass-key prompt, the relative error of the future decode attention output is 0.150 for
Algorithm 1 at 29% kept (AdaKV at the same 29%: 0.106) and 0.055 with w = 8 at 47% (AdaKV at 47%:
0.064). The answers are not recovered (0 of 24 at 2,048 tokens, either way): the model copies the key
digit by digit, and nucleus votes keep scattered entries where the copy needs the whole span, which
pooled scores (the SnapKV family) keep. docs/gvote.md has the tables.

Pooled votes (`kernel_size` k, default 1 = Algorithm 1 exactly): every vote, synthetic or observed,
ranks the keys by its scores max-pooled over k neighbouring positions before taking its top B, so it
keeps the span around what it attends (B entries still, fewer distinct peaks). A divergence, off by
default, for the span fragmentation above; its measured effect is in docs/gvote.md.

Vote-sized AdaKV (`allocation`, default "request"; "votes" = Algorithm 1 exactly): the votes set how
much each request keeps, and AdaKV (`adakv.py`, its paper's defaults: window 32, max-pooled k = 7 SnapKV
scores, alpha 0.2) chooses which entries, given

    "head"      |keep[l, g]|                         entries for KV head g of layer l (top scores)
    "layer"     mean_g |keep[l, g]|                  entries per head of layer l, AdaKV's head split
    "request"   sum_{l, g} |keep[l, g]| / (L * Hkv)  entries per head in every layer, AdaKV's head split

so the budget stays the votes' own (no ratio is set) and "request" spends exactly the memory
Algorithm 1 would (up to rounding per layer; "layer" and "request" never give a head fewer entries than
AdaKV's 32-entry window, nor more than the prompt). Measured on SmolLM2-135M (docs/gvote.md), the nucleus
budgets place memory across layers and heads as badly as the votes place it across positions: with
the same mean memory (25.7% kept at 2,048 tokens, served protocol), "head" answers 0%, "layer" 37.5%
and "request" 79.2%, what AdaKV scores at the same 26% (at 4,096 tokens: 83.3% against AdaKV's 87.5%).
On Gemma 3 270M "request" equals AdaKV at the memory it chose as well (75.0% and 75.0% at 2,048 tokens,
66.7% and 66.7% at 4,096).

Models with sliding-window layers (Gemma 3): the votes, and "request"'s total, cover the global layers
only (L is their count); each sliding layer's ring holds its window beside them, which the memory a
request reports includes.

Divergences:
- RoPE convention: the paper's listing rotates interleaved pairs (x[2i], x[2i+1]); here the model's
  own convention is used (HF "rotate_half": pairs (x[i], x[i + d/2]), with the model's frequency
  scaling, e.g. llama3), because that is how the cached keys were rotated. The averaged cos/sin
  come from `model.rotary.cos_sin`.
- The synthetic queries are projected by `project_queries` at position 0, where the rotation is
  the identity, which gives exactly the layer's pre-RoPE query (bias and q_norm included); the
  averaged rotation is then applied with `apply_rope`.
- GQA: the paper's votes are per attention head; here the union runs over the query heads of a
  KV head's group too (each query head with its own B[h]), so each KV head keeps one set of
  entries that serves all its query heads.
- Ties in a top-B selection go to the lower entry index (stable sort), so plans are deterministic.
- `allocation` = "request" by default, and any `allocation` other than "votes" (above).
- `observation_window` > 0 and `kernel_size` > 1 (above), both off by default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F

from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.models.rope import RotaryEmbedding, apply_rope
from vllm_kvpress_ext.policies.adakv import AdaKVPolicy, adaptive_head_keep
from vllm_kvpress_ext.policies.base import (
    KVPolicy,
    LayerPrefill,
    PolicyConfigError,
    RequestPrefill,
    check_choice,
    keep_top,
    recent_window,
)
from vllm_kvpress_ext.policies.capture import CaptureSpec

if TYPE_CHECKING:
    pass

SEED_STRIDE = 65537  # layer l of seed s draws from manual_seed(s * SEED_STRIDE + l)
# Who decides where the votes' memory goes: the votes themselves (Algorithm 1), or AdaKV's selection
# given the votes' budget per KV head, per layer or per request (module docstring).
ALLOCATIONS = ("votes", "head", "layer", "request")


def nucleus_size(probs: torch.Tensor, p_nuc: float) -> torch.Tensor:
    """Per row of `probs[R, n]`: the size of the smallest set whose mass reaches `p_nuc`, in [1, n]."""
    mass = torch.sort(probs, dim=-1, descending=True).values.cumsum(dim=-1)
    return ((mass < p_nuc).sum(dim=-1) + 1).clamp(max=probs.shape[-1])


def sample_noise(seed: int, layer: int, num_samples: int, dim: int) -> torch.Tensor:
    """eps `[S, D]` float64 on the CPU; row s is the same whatever `num_samples` is (see module docstring)."""
    generator = torch.Generator().manual_seed(seed * SEED_STRIDE + layer)
    return torch.stack([torch.randn(dim, generator=generator, dtype=torch.float64) for _ in range(num_samples)])


def future_rotation(
    rotary: RotaryEmbedding, first: int, count: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[d]` (fp32), each averaged over positions first .. first + count - 1."""
    cos, sin = rotary.cos_sin(torch.arange(first, first + count, device=device))
    return cos.mean(dim=0), sin.mean(dim=0)


def synthetic_queries(
    project: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Queries `[S, Hq, d]` (fp32) of hidden states `[S, D]` (`project`: the layer's query projection, before
    RoPE), rotated by the (averaged) `cos`, `sin` `[d]`."""
    unrotated = project(hidden)
    rows = unrotated.shape[0]
    return apply_rope(unrotated.float(), cos.float().expand(rows, -1), sin.float().expand(rows, -1))


def max_pooled(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """`scores[R, n]` max-pooled along positions over an odd `kernel_size` window (1: unchanged)."""
    if kernel_size == 1:
        return scores
    return F.max_pool1d(scores.unsqueeze(1), kernel_size, stride=1, padding=kernel_size // 2).squeeze(1)


def vote(queries: torch.Tensor, keys: torch.Tensor, budgets: torch.Tensor, kernel_size: int = 1) -> torch.Tensor:
    """Union keep mask `[Hkv, n]`: each query `queries[s, h]` keeps its top-`budgets[h]` keys of KV head h // G.

    queries `[S, Hq, d]`, keys `[Hkv, n, d]`, budgets `[Hq]`. Ties go to the lower index. One KV head at
    a time, so the working set is `[S * G, n]` scores (never a GQA-expanded copy of the keys). With
    `kernel_size` k > 1 each query ranks the keys by its scores max-pooled over k neighbouring positions.
    """
    num_kv, n = keys.shape[0], keys.shape[1]
    samples, num_q, dim = queries.shape
    group = num_q // num_kv
    queries = queries.to(device=keys.device, dtype=torch.float32)
    budgets = budgets.to(keys.device)
    keep = torch.zeros(num_kv, n, dtype=torch.bool, device=keys.device)
    for kv in range(num_kv):
        rows = queries[:, kv * group : (kv + 1) * group].reshape(samples * group, dim)  # row s * G + g
        scores = max_pooled(rows @ keys[kv].float().T, kernel_size)  # [S * G, n]
        take = budgets[kv * group : (kv + 1) * group].repeat(samples).clamp(1, n)  # [S * G]
        keep[kv] = top_with_low_ties(scores, take).any(dim=0)
    return keep


def top_with_low_ties(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Bool `[R, n]`: per row, the `counts[r]` (in [1, n]) highest scores, ties going to the lower index.

    The same set a stable descending sort would give, without ordering the indices: the counts[r]-th
    largest value is the row's threshold, found by a partial selection from whichever end is shorter
    (the counts[r]-th largest is the (n - counts[r] + 1)-th smallest); everything above it is kept,
    and of the entries equal to it the lowest-indexed ones fill the rest. Usually only the threshold
    itself sits at the threshold, and then "at or above" is the answer with no tie pass at all.
    """
    n = scores.shape[-1]
    counts = counts.view(-1, 1)
    from_top = int(counts.max())
    from_bottom = n - int(counts.min()) + 1
    if from_top <= from_bottom:
        values = torch.topk(scores, from_top, dim=-1, largest=True, sorted=True).values
        threshold = values.gather(-1, counts - 1)
    else:
        values = torch.topk(scores, from_bottom, dim=-1, largest=False, sorted=True).values
        threshold = values.gather(-1, n - counts)
    keep = scores >= threshold
    held = keep.sum(dim=-1, keepdim=True)
    if bool((held == counts).all()):
        return keep
    above = scores > threshold
    ties = scores == threshold
    room = counts - above.sum(dim=-1, keepdim=True)
    return above | (ties & (ties.cumsum(dim=-1) <= room))


@dataclass
class GVotePolicy(KVPolicy):
    """GVote; equations, defaults and divergences in the module docstring. Budget-free: no ratio/tokens."""

    name = "gvote"
    decides_across_layers = True  # its budget is one total for the request, split over every layer
    summary = "budget-free: union of top-p nucleus votes of Gaussian-sampled future queries (Tang et al. 2025)"

    # Each layer scores num_samples x future_positions synthetic queries against the whole prompt: these
    # bounds keep that within a few prefills of the prompt itself, whatever a request asks for.
    limits: ClassVar[dict[str, tuple[float, float]]] = {
        "num_samples": (1, 64),
        "future_positions": (1, 256),
        "observation_window": (0, 256),
        "kernel_size": (1, 63),
    }

    p_nuc: float = 0.95
    num_samples: int = 8
    future_positions: int = 32
    window: int = 0
    sink_tokens: int = 0
    seed: int = 0
    observation_window: int = 0
    kernel_size: int = 1
    allocation: str = "request"

    def validate(self) -> None:
        if not 0.0 < self.p_nuc <= 1.0:
            raise PolicyConfigError(
                f"p_nuc (nucleus mass of the last query's attention) must lie in (0, 1], got {self.p_nuc}"
            )
        for field, value in (("num_samples", self.num_samples), ("future_positions", self.future_positions)):
            if value < 1:
                raise PolicyConfigError(f"{field} must be >= 1, got {value}")
        for field, value in (
            ("window", self.window),
            ("sink_tokens", self.sink_tokens),
            ("seed", self.seed),
            ("observation_window", self.observation_window),
        ):
            if value < 0:
                raise PolicyConfigError(f"{field} must be >= 0, got {value}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise PolicyConfigError(f"kernel_size must be an odd number >= 1, got {self.kernel_size}")
        check_choice("allocation", self.allocation, ALLOCATIONS)

    @property
    def selector(self) -> AdaKVPolicy:
        """What chooses the entries when `allocation` is not "votes": AdaKV with its paper's defaults."""
        return AdaKVPolicy()

    def capture_spec(self) -> CaptureSpec:
        selector_window = self.selector.window if self.allocation != "votes" else 0
        return CaptureSpec(window=max(1, self.observation_window, selector_window), hidden_stats=True)

    def adakv_keep(self, scores: torch.Tensor, per_head: float) -> torch.Tensor:
        """AdaKV's keep mask `[Hkv, n]` for a layer whose heads keep `per_head` entries on average."""
        selector = self.selector
        heads, n = scores.shape
        window = min(selector.window, n)
        selectable = min(n, max(window, round(per_head))) - window
        protected = recent_window(n, window).expand(heads, n).contiguous()
        return adaptive_head_keep(scores, protected, selectable, int(selector.alpha * selectable))

    def nucleus_budgets(self, layer: LayerPrefill, index: int) -> torch.Tensor:
        """B `[Hq]` (int64, CPU): nucleus size of captured query `index`'s attention, per query head."""
        capture = layer.capture
        assert capture is not None and capture.queries is not None and capture.query_positions is not None
        keys = layer.keys
        query = capture.queries[index].to(device=keys.device, dtype=torch.float32)  # [Hq, d]
        group = query.shape[0] // layer.num_kv_heads
        visible = layer.positions.to(keys.device) <= capture.query_positions[index].to(keys.device)
        budgets = []
        for kv in range(layer.num_kv_heads):  # one KV head at a time: no GQA-expanded copy of the keys
            logits = (query[kv * group : (kv + 1) * group] @ keys[kv].float().T).double() * layer.scale
            probs = torch.softmax(logits.masked_fill(~visible.view(1, -1), float("-inf")), dim=-1)
            budgets.append(nucleus_size(probs, self.p_nuc))
        return torch.cat(budgets).cpu()

    def step_budgets(self, layer: LayerPrefill) -> torch.Tensor:
        """B[h] `[Hq]`: the nucleus size of the last prompt position's attention, per query head."""
        return self.nucleus_budgets(layer, -1)

    def observed_votes(self, layer: LayerPrefill) -> torch.Tensor:
        """Keep mask `[Hkv, n]`: the union of the attention nuclei of the last `observation_window` real queries.

        Each captured query (per query head) keeps the smallest set of the keys it could see whose mass
        reaches `p_nuc`, which is its own top-B vote with its own B; one pass per KV head for all of them.
        """
        capture = layer.capture
        assert capture is not None and capture.queries is not None and capture.query_positions is not None
        keys, device = layer.keys, layer.keys.device
        count = min(self.observation_window, capture.queries.shape[0])
        queries = capture.queries[-count:].to(device=device, dtype=torch.float32)  # [w, Hq, d]
        group = queries.shape[1] // layer.num_kv_heads
        # [w * G, n]: row (i, g) sees the keys at or before query i's position.
        visible = layer.positions.to(device).view(1, -1) <= capture.query_positions[-count:].to(device).view(-1, 1)
        visible = visible.repeat_interleave(group, dim=0)
        keep = torch.zeros(layer.num_kv_heads, layer.length, dtype=torch.bool, device=device)
        for kv in range(layer.num_kv_heads):
            rows = queries[:, kv * group : (kv + 1) * group].reshape(-1, queries.shape[-1])
            logits = ((rows @ keys[kv].float().T).double() * layer.scale).masked_fill(~visible, float("-inf"))
            sizes = nucleus_size(torch.softmax(logits, dim=-1), self.p_nuc)
            ranked = max_pooled(logits, self.kernel_size).masked_fill(~visible, float("-inf"))
            keep[kv] = top_with_low_ties(ranked, sizes).any(dim=0)
        return keep

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> torch.Tensor:
        capture = layer.capture
        assert capture is not None and capture.query_positions is not None
        budgets = self.step_budgets(layer)
        mean, std = capture.hidden_mean, capture.hidden_var.sqrt()
        noise = sample_noise(self.seed, layer.layer, self.num_samples, mean.shape[0])
        hidden = mean.cpu().double() + std.cpu().double() * noise  # [S, D]
        last = int(capture.query_positions[-1])
        cos, sin = future_rotation(layer.rope(self.name), last + 1, self.future_positions, layer.keys.device)
        queries = synthetic_queries(layer.query_projection(self.name), hidden, cos, sin)
        keep = vote(queries, layer.keys, budgets, self.kernel_size)
        if self.observation_window:
            keep |= self.observed_votes(layer)
        keep = keep.cpu()
        n = layer.length
        keep |= recent_window(n, self.window).view(1, n)
        keep[:, : self.sink_tokens] = True
        return keep if self.allocation == "votes" else self.reallocate(layer, keep)

    def reallocate(self, layer: LayerPrefill, keep: torch.Tensor) -> Any:
        """The votes' budget with AdaKV choosing: a keep mask, or (budgets, scores) for the request's plan."""
        counts = keep.sum(dim=-1)  # [Hkv]: what the votes kept per KV head
        scores = self.selector.scores(layer).cpu()
        if self.allocation == "head":
            protected = recent_window(layer.length, min(self.selector.window, layer.length))
            return keep_top(scores, counts, protected.expand_as(keep).contiguous())
        # Shared by the layer's or the request's heads: every tensor-parallel worker's, a plan over all of them.
        counts, scores = layer.all_heads(counts), layer.all_heads(scores)
        if self.allocation == "layer":
            return self.adakv_keep(scores, float(counts.float().mean()))
        return counts, scores  # "request": the plan spreads the request's total evenly

    def plan(self, request: RequestPrefill, layer_results: list[Any], state: dict[str, Any]) -> KeepPlan:
        if self.allocation != "request":
            return KeepPlan.from_mask(torch.stack(layer_results))
        total = sum(int(counts.sum()) for counts, _ in layer_results)
        per_head = total / sum(counts.numel() for counts, _ in layer_results)
        return KeepPlan.from_mask(torch.stack([self.adakv_keep(scores, per_head) for _, scores in layer_results]))
