"""`expected_attention`: keep the entries that future queries are expected to attend, from the queries' statistics.

Paper: Devoto, Jeblick, Jégou, "Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution" (arXiv 2510.00636, 2025); the reference is NVIDIA kvpress's
`ExpectedAttentionPress` (0.5.5), the press that leads kvpress's question-agnostic RULER board.

Equations, per layer, for a prompt of n entries with keys k_j and values v_j (post-RoPE keys, as cached),
S sink entries, query heads h in groups of G per KV head, and the last prompt position p:

    query moments   m[h], C[h] = mean and (population) covariance of the prompt's queries before
                                 RoPE, q_t[h] for t = S..n-1 (the sinks' outlier activations excluded)
    future rotation R̄ = mean over f = 1..F of R(p + f)             R(x): the model's RoPE at position x
    future query    m'[h] = R̄ m[h],   C'[h] = R̄ C[h] R̄^T
    expected logit  z_j[h] = s m'[h].k_j + s^2 k_j^T C'[h] k_j / 2  s = the attention scale (1/sqrt(d))
                                 = log E[exp(s q.k_j)] for q ~ N(m', C')
    score           a_j[g] = mean_{h in g} softmax_j(z[h])_j * (||v_j|| + 0)   (j >= S; `epsilon` added
                                 to the probability before the value norm, 0 by default)
    keep            the S sinks and the highest-scoring entries, B per KV head in all (sinks included)

No question is needed: the statistics describe the prompt's queries, so a context can be compressed
before the question exists (kvpress's question-agnostic protocol).

Defaults (kvpress 0.5.5): future_positions F = 512, sink_tokens S = 4, use_covariance and use_vnorm true,
epsilon 0. Budget: ratio 0.25 (this project's default for ratio-budgeted policies), or `tokens`.

Divergences:
- The moments are accumulated during prefill as per-head sums of q and q q^T of the queries before
  RoPE (`CaptureSpec.query_moments`, d*d per head; the queries come from the layer's own q path,
  bias and q_norm included, as kvpress 0.5.5's `get_prerope_query_states`), so chunked prefill and a
  shared prefix give the same statistics as one pass; the sinks' queries are subtracted afterwards.
- `s` is the layer's attention scale, which is 1/sqrt(d) in every model this engine loads (kvpress
  writes 1/sqrt(d) and 1/(2d)).
- A budget keeps round(ratio * n) entries per head (kvpress: int(n * (1 - compression_ratio))), and a
  prompt of at most S entries is kept whole (kvpress asserts n > S). Ties go to the lower index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.policies.base import (
    Budget,
    KVPolicy,
    LayerPrefill,
    PolicyConfigError,
    RequestPrefill,
    check_flag,
    keep_top,
)
from vllm_kvpress_ext.policies.capture import CaptureSpec


def mean_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """R̄ `[d, d]`: the mean of the RoPE rotations whose cos/sin rows `[F, d]` are given (rotate_half pairs)."""
    d = cos.shape[-1]
    half = d // 2
    swap = torch.zeros(d, d, dtype=cos.dtype, device=cos.device)  # swap @ x == rotate_half(x)
    swap[half:, :half] = torch.eye(half, dtype=cos.dtype, device=cos.device)
    swap[:half, half:] = -torch.eye(half, dtype=cos.dtype, device=cos.device)
    return torch.diag(cos.mean(0)) + torch.diag(sin.mean(0)) @ swap


def expected_logits(keys: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor | None, scale: float) -> torch.Tensor:
    """z `[G, n]` for one KV head's keys `[n, d]` and its G query heads' moments `[G, d]`, `[G, d, d]`."""
    logits = scale * (mean @ keys.T)
    if cov is not None:
        logits = logits + 0.5 * scale * scale * torch.einsum("nd,gde,ne->gn", keys, cov, keys)
    return logits


@dataclass
class ExpectedAttentionPolicy(KVPolicy):
    """Expected Attention; equations, defaults and divergences in the module docstring."""

    name = "expected_attention"
    question_agnostic = True
    summary = (
        "attention expected from the prompt queries' Gaussian statistics x value norm, sinks kept (Devoto et al. 2025)"
    )

    limits: ClassVar[dict[str, tuple[float, float]]] = {"future_positions": (1, 4096), "epsilon": (0.0, 1e6)}

    ratio: float | None = 0.25
    tokens: int | None = None
    future_positions: int = 512
    sink_tokens: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    @property
    def budget(self) -> Budget:
        return Budget(ratio=self.ratio, tokens=self.tokens)

    def validate(self) -> None:
        self.budget.validate()
        if self.future_positions < 1:
            raise PolicyConfigError(f"future_positions must be >= 1, got {self.future_positions}")
        if self.sink_tokens < 0:
            raise PolicyConfigError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.epsilon < 0:
            raise PolicyConfigError(f"epsilon must be >= 0, got {self.epsilon}")
        check_flag("use_covariance", self.use_covariance)
        check_flag("use_vnorm", self.use_vnorm)

    def capture_spec(self) -> CaptureSpec:
        return CaptureSpec(query_moments=True, leading_queries=self.sink_tokens)

    def scores(self, layer: LayerPrefill) -> torch.Tensor:
        """a `[Hkv, n - S]` (float32): expected attention of the non-sink entries, times their value norms."""
        capture = layer.capture
        assert capture is not None
        keys, device = layer.keys, layer.keys.device
        sinks = self.sink_tokens
        mean, cov = capture.query_mean_cov(skip=sinks)
        last = int(layer.positions.max())
        rotary = layer.rope(self.name)
        cos, sin = rotary.cos_sin(torch.arange(last + 1, last + 1 + self.future_positions, device=device))
        rotation = mean_rotation(cos.double(), sin.double())
        mean = (mean.to(device) @ rotation.T).float()
        future_cov = (rotation @ cov.to(device) @ rotation.T).float() if self.use_covariance else None
        group = mean.shape[0] // layer.num_kv_heads
        heads = []
        for kv in range(layer.num_kv_heads):  # one KV head at a time: no GQA-expanded copy of the keys
            rows = slice(kv * group, (kv + 1) * group)
            head_cov = None if future_cov is None else future_cov[rows]
            logits = expected_logits(keys[kv, sinks:].float(), mean[rows], head_cov, layer.scale)
            heads.append(torch.softmax(logits, dim=-1).mean(0))
        scores = torch.stack(heads)
        if self.use_vnorm:
            scores = (scores + self.epsilon) * layer.values[:, sinks:].float().norm(dim=-1)
        return scores

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> torch.Tensor:
        n, heads = layer.length, layer.num_kv_heads
        if n <= self.sink_tokens:
            return torch.ones(heads, n, dtype=torch.bool)
        scores = torch.cat([torch.zeros(heads, self.sink_tokens, device=layer.keys.device), self.scores(layer)], dim=1)
        sinks = torch.zeros(heads, n, dtype=torch.bool)
        sinks[:, : self.sink_tokens] = True
        return keep_top(scores, torch.full((heads,), self.budget.per_head(n)), sinks)

    def plan(self, request: RequestPrefill, layer_results: list[Any], state: dict[str, Any]) -> KeepPlan:
        return KeepPlan.from_mask(torch.stack(layer_results))
