"""Turn the last-position logits of a batch into next tokens.

Greedy rows are one argmax for the whole batch; sampled rows apply temperature, top-k and top-p
and draw from their own `torch.Generator` (seeded per request, so a seeded request gives the same
tokens whatever else shares its batch).
"""

from __future__ import annotations

import torch

from vllm_kvpress_ext.engine.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits `[V]` with everything outside top-k / top-p set to -inf."""
    scaled = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """`logits[B, V]` -> one token per row."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(filter_logits(logits[i], p), dim=-1)
        tokens[i] = int(torch.multinomial(probs.cpu(), 1, generator=generators[i]).item())
    return tokens
