"""The context-reconstruction pass (KVzip): after a prefill, ask the model to repeat the prompt and score every entry.

A policy asks for it through `CaptureSpec.reconstruction` (`policies/capture.py`); the model runner runs
it when the prefill completes, before the policy's hooks, and leaves each layer's scores in
`LayerCapture.reconstruction_scores`. Every driver goes through that one place: the embedded engine,
requests forked from a shared prefix (`engine/prefix.py`: the prefix's capture pass computes the scores
once and every fork copies them), the vLLM plugin's worker, and the plugin's pool on vLLM's runner,
whose model runs each chunk through its attention backend (`score_prompt` takes the forward).

The pass, for a prompt of n cached tokens cut into chunks [s, e) of `chunk_size` tokens:

    input_c   = repeat prompt (chunk 0) or resume prompt + the last `overlap_tokens` tokens before s,
                then the chat template's end-of-user-turn / assistant header, then tokens[s:e]
    forward   = input_c at positions n, n + 1, ... : every layer's queries attend to the whole cached
                prompt (read from the request's pages) and causally to input_c's own keys
    score     = for each cached entry j in [s, e), KV head g:
                max over the queries i of input_c and the query heads h of g of
                softmax_i over {entries 0..S-1, entries s..e-1, input_c's keys up to i} at j

Nothing of input_c is written to the cache: each layer's chunk K/V live only while that layer runs, so
the pass holds no second copy of the prompt's K/V. Memory beyond the cache: one chunk's activations,
one layer's prompt K/V densified from its pages (as a chunked prefill's attention does) and blocks of
`QUERY_BLOCK` queries' logits. Compute: a forward of about n more tokens whose queries each read the
whole prompt, plus the score blocks (one more set of logits over each chunk's cached entries): about
2.7 prefills on SmolLM2-135M at 2,048 tokens (docs/policies.md), where attention is most of the work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm_kvpress_ext.attention import gather_paged, sliding_window_attention
from vllm_kvpress_ext.attention.reference import soft_capped
from vllm_kvpress_ext.cache import PagedKVCache
from vllm_kvpress_ext.models import load_tokenizer
from vllm_kvpress_ext.policies.capture import ReconstructionSpec

if TYPE_CHECKING:
    from vllm_kvpress_ext.engine.model_runner import ModelRunner
    from vllm_kvpress_ext.engine.request import Request

# The instructions KVzip's reference code (and kvpress's KVzipPress) put before each chunk.
REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly."
RESUME_INSTRUCTION = "\n\nRepeat the part of the previous context exactly, starting with"
#: Queries scored at once: bounds the score block to QUERY_BLOCK x (sinks + chunk) per query head.
QUERY_BLOCK = 256
_MARKER = "\u2063kvzip-context\u2063"


@dataclass(frozen=True)
class ReconstructionPrompts:
    """Token ids of the two instructions, of what the chat template puts between a user turn and the answer, and
    of what it puts before a user message's content (a default system prompt included)."""

    repeat: tuple[int, ...]
    resume: tuple[int, ...]
    answer_header: tuple[int, ...]
    context_header: tuple[int, ...] = ()


def reconstruction_prompts(tokenizer: Any) -> ReconstructionPrompts:
    """The prompts for this tokenizer; the headers are the chat template's text around a user message."""
    before, header = "", "\n"
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _MARKER}], add_generation_prompt=True, tokenize=False
        )
        if _MARKER in rendered:
            before, header = rendered.split(_MARKER, 1)

    def ids(text: str) -> tuple[int, ...]:
        return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))

    return ReconstructionPrompts(ids(REPEAT_INSTRUCTION), ids(RESUME_INSTRUCTION), ids(header), ids(before))


@functools.lru_cache(maxsize=8)
def prompts_for_model(model_dir: str) -> ReconstructionPrompts:
    """`reconstruction_prompts` of a model's own tokenizer, loaded once per model."""
    tokenizer = load_tokenizer(Path(model_dir))
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer: the context-reconstruction pass needs one for its prompt")
    return reconstruction_prompts(tokenizer)


def chunk_inputs(
    tokens: list[int], spec: ReconstructionSpec, prompts: ReconstructionPrompts
) -> list[tuple[int, int, list[int]]]:
    """(start, end, input ids) of every chunk: the reconstruction of tokens[start:end] and its prompt. With
    `spec.skip_header`, it starts after as many tokens as the chat template's context header has, as kvpress's
    `KVzipPress` does (whether or not the prompt opens with that header: kvpress does not check)."""
    first = min(len(prompts.context_header), len(tokens)) if spec.skip_header else 0
    chunks = []
    for start in range(first, len(tokens), spec.chunk_size):
        end = min(start + spec.chunk_size, len(tokens))
        if start == first:
            prompt = list(prompts.repeat)
        else:
            prompt = list(prompts.resume) + tokens[max(first, start - spec.overlap_tokens) : start]
        chunks.append((start, end, prompt + list(prompts.answer_header) + tokens[start:end]))
    return chunks


def reconstruction_chunk_scores(
    queries: torch.Tensor,
    own_keys: torch.Tensor,
    sink_keys: torch.Tensor,
    span_keys: torch.Tensor,
    scale: float,
    own_lse: torch.Tensor | None = None,
    query_block: int = QUERY_BLOCK,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Scores `[Hkv, c]` of a chunk's c cached entries from its reconstruction queries.

    queries `[m, Hq, d]` and own_keys `[m, Hkv, d]` are the reconstruction input's (post-RoPE); sink_keys
    `[Hkv, S, d]` and span_keys `[Hkv, c, d]` the cached entries. Query i's softmax runs over the sinks,
    the span and own keys 0..i; an entry's score is the largest probability it gets from any query of
    its KV head's group. `own_lse` `[m, Hq]`, the log-sum-exp of each query over its own causal keys,
    is what the pass's attention already computed; without it, it is computed here. Queries go
    `query_block` at a time, so no `[Hq, m, c]` block is ever built.

    The maximum is taken on log-probabilities, max_i exp(x_ij - lse_i) = exp(max_i (x_ij - lse_i)), so
    only the scores themselves are exponentiated beyond the normalisers. With `soft_cap` the logits are
    capped (`soft_capped`) before the softmax, as the model's attention caps them.
    """
    m, num_q_heads, _ = queries.shape
    num_kv_heads, span = sink_keys.shape[0], span_keys.shape[1]
    group = num_q_heads // num_kv_heads
    cached = torch.cat([sink_keys, span_keys], dim=1).float().repeat_interleave(group, dim=0)  # [Hq, S + c, d]
    sinks = sink_keys.shape[1]
    own = own_keys.transpose(0, 1).float().repeat_interleave(group, dim=0) if own_lse is None else None  # [Hq, m, d]
    best = torch.full((num_q_heads, span), float("-inf"), dtype=torch.float32, device=queries.device)
    for first in range(0, m, query_block):
        last = min(m, first + query_block)
        q = queries[first:last].float().transpose(0, 1)  # [Hq, b, d]
        logits = soft_capped(torch.matmul(q, cached.transpose(1, 2)) * scale, soft_cap)  # [Hq, b, S + c]
        if own is None:
            assert own_lse is not None
            own_block = own_lse[first:last].float().transpose(0, 1)  # [Hq, b]
        else:
            own_logits = soft_capped(torch.matmul(q, own[:, :last].transpose(1, 2)) * scale, soft_cap)  # [Hq, b, last]
            future = torch.arange(last, device=q.device).view(1, -1) > torch.arange(first, last, device=q.device).view(
                -1, 1
            )
            own_block = torch.logsumexp(own_logits.masked_fill(future, float("-inf")), dim=-1)
        lse = torch.logaddexp(torch.logsumexp(logits, dim=-1), own_block)  # [Hq, b]
        best = torch.maximum(best, (logits[..., sinks:] - lse.unsqueeze(-1)).amax(dim=1))
    return best.exp().view(num_kv_heads, group, span).amax(dim=1)


def attention_with_lse(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    causal: bool,
    scale: float,
    soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query `[Hq, m, d]` over keys / values `[Hkv, N, d]` (causal: query i sees keys 0..i) and each
    query's log-sum-exp `[Hq, m]` (float32): torch's CPU flash kernel where it exists and no `soft_cap` applies,
    else an explicit softmax (of the capped logits)."""
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is not None and query.device.type == "cpu" and soft_cap is None:
        out, lse = flash(query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), 0.0, causal, scale=scale)[:2]
        return out[0], lse[0].float()
    group = query.shape[0] // keys.shape[0]
    expanded_keys = keys.float().repeat_interleave(group, dim=0).transpose(1, 2)  # [Hq, d, N]
    expanded_values = values.float().repeat_interleave(group, dim=0)  # [Hq, N, d]
    m, n = query.shape[1], keys.shape[1]
    outs, lses = [], []
    for first in range(0, m, QUERY_BLOCK):  # query blocks: no [Hq, m, N] logits at once
        last = min(m, first + QUERY_BLOCK)
        logits = soft_capped(torch.matmul(query[:, first:last].float(), expanded_keys) * scale, soft_cap)
        if causal:
            rows = torch.arange(first, last, device=query.device).view(-1, 1)
            logits = logits.masked_fill(torch.arange(n, device=query.device).view(1, -1) > rows, float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        outs.append(torch.matmul(torch.exp(logits - lse.unsqueeze(-1)), expanded_values))
        lses.append(lse)
    return torch.cat(outs, dim=1).to(query.dtype), torch.cat(lses, dim=1)


class ReconstructionContext:
    """The `AttentionContext` of one reconstruction chunk of one request: attends, scores, writes nothing."""

    def __init__(
        self,
        cache: PagedKVCache,
        row: int,
        span: tuple[int, int],
        spec: ReconstructionSpec,
        scale: float,
        scores: list[torch.Tensor],
        prompt_length: int,
        soft_caps: list[float | None] | None = None,
    ) -> None:
        self.cache = cache
        self.soft_caps = soft_caps  # per layer, the attention's logit soft cap (Gemma 2), as the model applies it
        self.prompt_length = prompt_length  # the chunk's queries sit right after the prompt
        self.row = row
        self.span = span
        self.spec = spec
        self.scale = scale
        self.scores = scores  # per layer [Hkv, n], filled at the span

    def attend(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pre_rope: torch.Tensor,
    ) -> torch.Tensor:
        cache = self.cache
        soft_cap = self.soft_caps[layer_idx] if self.soft_caps is not None else None
        keys, values, positions, valid = gather_paged(
            cache.pool.kv,
            cache.pool.positions,
            cache.device_block_tables[layer_idx, self.row],
            cache.device_seq_lens[layer_idx, self.row],
        )  # [Hkv, n, d]: the uncompressed prompt, in position order
        window = int(cache.layer_windows[layer_idx])
        if window:
            # A sliding layer's ring holds the prompt's last tokens; no policy scores it, it only has to attend.
            held = valid[0]
            chunk_positions = torch.arange(self.prompt_length, self.prompt_length + q.shape[0], device=q.device)
            return sliding_window_attention(
                q,
                chunk_positions,
                torch.cat([keys[:, held].transpose(0, 1).to(k.dtype), k]),
                torch.cat([values[:, held].transpose(0, 1).to(v.dtype), v]),
                torch.cat([positions[0, held].to(chunk_positions.dtype), chunk_positions]),
                window,
                self.scale,
                soft_cap=soft_cap,
            )
        n = keys.shape[1]
        if not bool(valid.all()) or not torch.equal(positions[0].long(), torch.arange(n, device=positions.device)):
            raise ValueError("the reconstruction pass needs every head to hold the whole uncompressed prompt")
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        # Every cached prompt entry lies before all of the chunk's queries; the chunk's own keys are causal.
        # The two attentions merge by their log-sum-exps, and the own part's serves the scores too.
        queries = q.transpose(0, 1)  # [Hq, m, d]
        cached_out, cached_lse = attention_with_lse(queries, keys, values, False, self.scale, soft_cap)
        own_out, own_lse = attention_with_lse(queries, k.transpose(0, 1), v.transpose(0, 1), True, self.scale, soft_cap)
        total = torch.logaddexp(cached_lse, own_lse).unsqueeze(-1)
        out = cached_out * torch.exp(cached_lse.unsqueeze(-1) - total) + own_out * torch.exp(
            own_lse.unsqueeze(-1) - total
        )
        start, end = self.span
        sinks = min(self.spec.sink_tokens, start)
        self.scores[layer_idx][:, start:end] = reconstruction_chunk_scores(
            q, k, keys[:, :sinks], keys[:, start:end], self.scale, own_lse.transpose(0, 1), soft_cap=soft_cap
        ).to(self.scores[layer_idx].device)
        return out.transpose(0, 1).to(q.dtype)


#: Runs one chunk's forward: (its context, which attends and scores, its input ids, their positions).
ChunkForward = Callable[["ReconstructionContext", list[int], torch.Tensor], None]


@torch.no_grad()
def score_prompt(
    cache: PagedKVCache,
    row: int,
    tokens: list[int],
    spec: ReconstructionSpec,
    prompts: ReconstructionPrompts,
    scale: float,
    forward: ChunkForward,
    soft_caps: list[float | None] | None = None,
) -> list[torch.Tensor]:
    """Per layer `[Hkv, n]` float32 scores of a row's n cached prompt entries (`tokens`), one chunk's forward at a
    time through `forward` (the model of whichever runner hosts the row); the first S are +inf (kept).
    `soft_caps`: each layer's logit soft cap, where the model's attention has one (Gemma 2)."""
    n = len(tokens)
    scores = [torch.zeros(cache.num_kv_heads, n, dtype=torch.float32) for _ in range(cache.num_layers)]
    for start, end, ids in chunk_inputs(tokens, spec, prompts):
        forward(
            ReconstructionContext(cache, row, (start, end), spec, scale, scores, n, soft_caps),
            ids,
            torch.arange(n, n + len(ids)),
        )
    for layer in scores:
        layer[:, : spec.sink_tokens] = float("inf")
    return scores


def reconstruction_scores(runner: ModelRunner, request: Request, spec: ReconstructionSpec) -> list[torch.Tensor]:
    """`score_prompt` of a request of the embedded engine's runner."""
    assert request.seat.row is not None
    device = runner.device

    def forward(context: ReconstructionContext, ids: list[int], positions: torch.Tensor) -> None:
        runner.model(torch.tensor(ids, device=device), positions.to(device), context)

    tokens = request.all_token_ids[: request.seat.num_processed]
    prompts = prompts_for_model(str(runner.model_dir))
    return score_prompt(runner.cache, request.seat.row, tokens, spec, prompts, runner.scale, forward)


def score_by_reconstruction(runner: ModelRunner, request: Request) -> None:
    """Run the pass if the request's capture asks for it and does not hold its scores yet (a fork copies them)."""
    capture = request.seat.capture
    if capture is None or capture.spec.reconstruction is None:
        return
    if capture.layers and capture.layers[0].reconstruction_scores is not None:
        return
    if request.seat.admission is not None:
        raise ValueError("the reconstruction pass needs the whole prompt cached; a write gate drops part of it")
    scores = reconstruction_scores(runner, request, capture.spec.reconstruction)
    for layer, layer_scores in zip(capture.layers, scores, strict=True):
        layer.reconstruction_scores = layer_scores
