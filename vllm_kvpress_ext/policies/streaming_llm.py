"""`streaming_llm`: attention sinks plus a sliding window of the most recent tokens.

Paper: Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024).
Reference implementation: `StartRecentKVCache` in `streaming_llm/kv_cache.py` of the authors'
streaming-llm repository.

Equations, per (layer, KV head), with B entries kept per head (sinks included):

    S     = min(sink_tokens, B - 1)                  sinks (at least one recent slot remains)
    keep  = { t : t < S }  U  { the B - S most recent positions }

At prefill the plan keeps exactly that. After every decode step (the new token is already in the
cache), each head holding more than B entries evicts the entries that are neither sinks nor among
its B - S most recent positions, so the cache never holds more than B entries per head. Entries
are found by their stored positions (`DecodeLayer.positions`), never by index: decode-time eviction
moves entries around.

No attention is needed, so nothing is captured and no decode attention is asked for.

Defaults: sink_tokens = 4 (the paper's and the reference's `start_size`). Budget default: ratio
0.25, the project-wide default (the reference runs with a fixed 4 + 2000 token cache; pass
`tokens: 2004` for that).

Budget during decode: with `tokens`, the cap is `tokens` (a prompt shorter than that is kept whole
and the cache grows up to the cap); with `ratio`, the cap is fixed at prefill to round(ratio * n)
for the n prompt tokens present at compression, and it stays there however long generation runs.

Divergences:
- The reference keeps one cache for all heads; here each (layer, KV head) is bounded on its own
  (they coincide, since every head keeps the same positions).
- The reference re-assigns positions inside the cache (RoPE on cache positions, so a rolling
  cache never exceeds the trained context); here keys are stored post-RoPE at their original
  positions, as every other policy of this project does, so positions keep growing.
- A budget smaller than sink_tokens + 1 shrinks the sinks (the budget wins, as for windows in
  `policies/base.py`); a `tokens` budget of 1 keeps only the most recent token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.policies.base import (
    Budget,
    DecodeEviction,
    DecodeStep,
    KVPolicy,
    LayerPrefill,
    PolicyConfigError,
    RequestPrefill,
)
from vllm_kvpress_ext.policies.capture import CaptureSpec


def most_recent(positions: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
    """Bool mask over `positions[..., N]` (-1 = padding): the `count` largest valid positions of each row."""
    positions = positions.to(torch.int64)
    valid = positions >= 0
    n = positions.shape[-1]
    count_t = torch.as_tensor(count, dtype=torch.int64).expand(positions.shape[:-1])
    if n == 0:
        return valid
    ranked = torch.sort(positions, dim=-1, descending=True).values  # padding (-1) sorts last
    kth = ranked.gather(-1, (count_t - 1).clamp(0, n - 1).unsqueeze(-1))
    kth = torch.where(count_t.unsqueeze(-1) > 0, kth, torch.full_like(kth, torch.iinfo(torch.int64).max))
    return valid & (positions >= kth)


def evictions(mask: torch.Tensor) -> DecodeEviction | None:
    """`mask[L, H, N]` of entries to drop, as the parallel lists `DecodeEviction` wants (None if empty)."""
    if not bool(mask.any()):
        return None
    layers, heads, entries = mask.nonzero().unbind(-1)
    return DecodeEviction(layers=layers, heads=heads, entries=entries)


@dataclass
class StreamingLLMPolicy(KVPolicy):
    """StreamingLLM; equations, defaults and divergences in the module docstring."""

    name = "streaming_llm"
    question_agnostic = True
    summary = "attention sinks + most recent tokens, bounded during decode (Xiao et al. 2024)"

    ratio: float | None = 0.25
    tokens: int | None = None
    sink_tokens: int = 4

    @property
    def budget(self) -> Budget:
        return Budget(ratio=self.ratio, tokens=self.tokens)

    def validate(self) -> None:
        if self.sink_tokens < 0:
            raise PolicyConfigError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        self.budget.validate()

    def capture_spec(self) -> CaptureSpec:
        return CaptureSpec()

    @property
    def wants_decode_steps(self) -> bool:
        return True

    def cap(self, length: int) -> int:
        """Entries per head kept from now on, for a request compressed with `length` prompt entries."""
        return self.budget.decode_cap(length)

    def sinks(self, cap: int) -> int:
        return max(0, min(self.sink_tokens, cap - 1))

    def keep_mask(self, positions: torch.Tensor, cap: int) -> torch.Tensor:
        """Entries of `positions[..., N]` that stay: sinks and the `cap - sinks` most recent."""
        sinks = self.sinks(cap)
        return ((positions >= 0) & (positions < sinks)) | most_recent(positions, cap - sinks)

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> torch.Tensor:
        cap = self.cap(layer.length)
        state["cap"] = cap
        positions = layer.positions.cpu().to(torch.int64).view(1, -1).expand(layer.num_kv_heads, -1)
        return self.keep_mask(positions, cap)

    def plan(self, request: RequestPrefill, layer_results: list[Any], state: dict[str, Any]) -> KeepPlan:
        return KeepPlan.from_mask(torch.stack(layer_results))

    def on_decode_step(self, step: DecodeStep, state: dict[str, Any]) -> DecodeEviction | None:
        cap = int(state["cap"])
        positions = torch.stack([layer.positions for layer in step.layers]).to(torch.int64)  # [L, H, N]
        lengths = torch.stack([layer.lengths for layer in step.layers]).to(torch.int64)  # [L, H]
        if not bool((lengths > cap).any()):
            return None
        drop = (positions >= 0) & ~self.keep_mask(positions, cap) & (lengths > cap).unsqueeze(-1)
        return evictions(drop)
