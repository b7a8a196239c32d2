"""Turn the last-position logits of a batch into next tokens.

Rows that need nothing but an argmax (greedy, no penalty or logit bias, no `min_tokens` pending) are one
argmax for the whole batch. Other rows get, in vLLM's order: `min_tokens` suppression, the logit bias,
penalties, then (sampled
rows) temperature, top-k, top-p and min-p, and a draw from their own `torch.Generator` (seeded per
request, so a seeded request gives the same tokens whatever else shares its batch).

Every filter keeps at least the most likely token, so no setting a request can pass leaves a row
without a finite logit (which would make the draw fail for the whole batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm_kvpress_ext.engine.sampling_params import SamplingParams


class SamplingState(Protocol):
    """What the sampler reads of a request."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Logits `[V]` after vLLM's repetition, presence and frequency penalties."""
    vocab = logits.numel()
    out = logits.float().clone()
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor([t for t in prompt + output if 0 <= t < vocab], dtype=torch.long)] = True
        seen = seen.to(out.device)
        penalized = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
        out = torch.where(seen, penalized, out)
    if output and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        counts = torch.bincount(torch.tensor([t for t in output if 0 <= t < vocab], dtype=torch.long), minlength=vocab)
        counts = counts.to(device=out.device, dtype=out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(out.dtype)
    return out


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits `[V]` with each `logit_bias` value added to its token's logit (a token beyond the vocabulary has
    none to move: the servers refuse it before it gets here)."""
    vocab = logits.shape[-1]
    pairs = [(token, bias) for token, bias in params.logit_bias if token < vocab]
    if not pairs:
        return logits
    tokens = torch.tensor([token for token, _ in pairs], dtype=torch.int64, device=logits.device)
    biases = torch.tensor([bias for _, bias in pairs], dtype=logits.dtype, device=logits.device)
    return logits.index_add(-1, tokens, biases)


def suppress_stops(logits: torch.Tensor, params: SamplingParams, produced: int, eos: Collection[int]) -> torch.Tensor:
    """EOS (unless ignored) and `stop_token_ids` at -inf while fewer than `min_tokens` are out."""
    if produced >= params.min_tokens:
        return logits
    banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    banned = {t for t in banned if 0 <= t < logits.numel()}
    if not banned or len(banned) == logits.numel():
        return logits
    out = logits.float().clone()
    out[torch.tensor(sorted(banned), dtype=torch.long, device=out.device)] = float("-inf")
    return out


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits `[V]` with everything outside top-k / top-p / min-p set to -inf."""
    scaled = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p. The first token always stays: a
        # top_p that rounds to 0 in float32 (1e-300) would otherwise drop every token.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    if params.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return scaled


def _draw(scaled: torch.Tensor, generator: torch.Generator | None) -> int:
    probs = torch.softmax(scaled, dim=-1).cpu()
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        return int(torch.argmax(scaled).item())  # degenerate logits (e.g. all -inf but one +inf): its argmax
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(logits: torch.Tensor, requests: Sequence[SamplingState], eos: Collection[int] = ()) -> list[int]:
    """`logits[B, V]` -> one token per row of `requests`."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for i, r in enumerate(requests):
        p = r.params
        pending_min = len(r.output_token_ids) < p.min_tokens
        if p.plain_argmax and not pending_min:
            continue
        row = logits[i]
        if pending_min:
            row = suppress_stops(row, p, len(r.output_token_ids), eos)
        if p.logit_bias:
            row = apply_logit_bias(row, p)
        if p.penalized:
            row = apply_penalties(row, p, r.prompt_token_ids, r.output_token_ids)
        tokens[i] = int(torch.argmax(row).item()) if p.greedy else _draw(filter_logits(row, p), r.generator)
    return tokens


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model, its rank, and the `k` most likely alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 for the most likely token
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """For rows `logits[N, V]` and the token each row produced (or was followed by), its `TokenLogprob`.

    A log-softmax of the logits as given (the model's raw logits), in float32, so the figures do not
    depend on which other requests share the batch or on the sampling settings.
    """
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(list(token_ids), dtype=torch.long, device=logprobs.device)
    chosen_lp = logprobs.gather(1, chosen.view(-1, 1)).view(-1)
    ranks = (logprobs > chosen_lp.view(-1, 1)).sum(dim=-1) + 1
    top_values, top_ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    chosen_list, ranks_list = chosen_lp.tolist(), ranks.tolist()
    values_list, ids_list = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(
            int(t), float(chosen_list[i]), int(ranks_list[i]), tuple(zip(ids_list[i], values_list[i], strict=True))
        )
        for i, t in enumerate(token_ids)
    ]


class LogprobsState(Protocol):
    params: SamplingParams
    output_logprobs: list[TokenLogprob]


def record_logprobs(requests: Sequence[LogprobsState], logits: torch.Tensor, tokens: Sequence[int]) -> None:
    """Append the `TokenLogprob` of each sampled token to `output_logprobs`, for the requests that ask."""
    rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    if not rows:
        return
    k = max(int(requests[i].params.logprobs or 0) for i in rows)
    entries = token_logprobs(logits[rows], [tokens[i] for i in rows], k)
    for i, entry in zip(rows, entries, strict=True):
        wanted = int(requests[i].params.logprobs or 0)
        requests[i].output_logprobs.append(entry if wanted == k else dataclasses.replace(entry, top=entry.top[:wanted]))
