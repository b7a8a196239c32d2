"""The two moments a policy changes a request's cache, shared by every runner that hosts policies.

- `compress_prefill`: the request's prompt is in the cache (every layer, every KV head): the policy sees
  each layer (`on_layer_prefilled`), plans (`plan`), and the cache compacts to the plan.

A model's sliding-window layers (Gemma 3's local layers) are not the policy's: their ring already holds
only the window their next query reads. The policy sees the global layers alone, numbered 0.. in order
(`LayerPrefill.layer`, with `model_layer` the model's index), so a per-layer schedule or a cross-layer
budget is spread over the layers that grow with the context.
- `evict_after_decode`: a decode token was written and attended: a decode-time policy (H2O, bounded
  StreamingLLM) may drop entries.

The embedded engine's model runner and the plugin's pool on vLLM's runner (`vllm_plugin/native/`) both
call these, so a policy sees the same inputs, and plans the same kept sets, on either path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_kvpress_ext.cache import InvalidPlanError, KeepPlan, PagedKVCache, PoolExhaustedError
from vllm_kvpress_ext.models.llama import LlamaFamilyForCausalLM
from vllm_kvpress_ext.models.rope import RotaryEmbedding
from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.policies.base import DecodeLayer, DecodeStep, HeadShard, LayerPrefill, RequestPrefill
from vllm_kvpress_ext.policies.capture import PrefillCapture


def layer_prefill(
    cache: PagedKVCache,
    request_id: str,
    layer: int,
    capture: PrefillCapture | None,
    model: LlamaFamilyForCausalLM | None,
    scale: float,
    gated: bool = False,
    rotary: RotaryEmbedding | None = None,
    queries_from_hidden: Callable[[torch.Tensor], torch.Tensor] | None = None,
    shard: HeadShard | None = None,
) -> LayerPrefill:
    """What a policy sees of one layer after prefill: the entries it holds and what the pass captured.

    `gated` (WG-KV admission) passes every head's own positions: heads hold different entries. Where `model`
    is not the project's, `rotary` is the model's RoPE and `queries_from_hidden` the layer's query projection.
    """
    keys, values, positions, _ = cache.gather_layer(request_id, layer)
    compressed = cache.global_layers.tolist()
    if layer not in compressed:
        raise ValueError(f"layer {layer} slides over a window: no policy compresses it")
    return LayerPrefill(
        layer=compressed.index(layer),
        num_layers=len(compressed),
        model_layer=layer,
        keys=keys,
        values=values,
        positions=positions[0],
        capture=capture.layers[layer] if capture is not None else None,  # the capture is by model layer
        model=model,
        scale=scale,
        head_positions=positions if gated else None,
        rotary=rotary,
        queries_from_hidden=queries_from_hidden,
        shard=shard,
    )


def workers_part(plan: KeepPlan, shard: HeadShard | None) -> KeepPlan:
    """A policy's plan as this worker applies it: under tensor parallelism a plan over all heads (a policy whose
    decision crossed heads) is cut to the worker's heads; a plan over the worker's heads is its own already."""
    if shard is None:
        return plan
    heads = plan.lengths.shape[1] if plan.lengths.dim() == 2 else -1
    if heads == shard.total:
        return plan.heads(shard.first, shard.count)
    if heads == shard.count:
        return plan
    raise InvalidPlanError(f"keep plan covers {heads} KV heads; this worker holds {shard.count} of {shard.total}")


def compress_prefill(
    cache: PagedKVCache,
    request_id: str,
    policy: KVPolicy,
    capture: PrefillCapture | None,
    *,
    num_q_heads: int,
    length: int,
    model: LlamaFamilyForCausalLM | None,
    scale: float,
    state: dict[str, Any],
    gated: bool = False,
    rotary: RotaryEmbedding | None = None,
    query_projections: list[Callable[[torch.Tensor], torch.Tensor]] | None = None,
    make_room: Callable[[], bool] | None = None,
    shard: HeadShard | None = None,
) -> None:
    """Score every layer, plan, compact the request's cache to the plan (`state` is the policy's, kept
    for its decode steps). `rotary` and `query_projections` (per layer) stand in for `model`'s where the
    model is not the project's; `shard` is this worker's heads under tensor parallelism. A compaction that
    moves kept entries into pages the row shares (an exact cached prefix) copies those pages first; where the
    pool has no room for the copies, `make_room` frees some (False: nothing left to free) and the compaction
    is tried again."""
    results = []
    layers = cache.global_layers.tolist()
    if not layers:
        return  # every layer slides (Mistral 7B v0.1): each already holds no more than its window
    for layer in layers:
        project = query_projections[layer] if query_projections is not None else None
        seen = layer_prefill(cache, request_id, layer, capture, model, scale, gated, rotary, project, shard)
        results.append(policy.on_layer_prefilled(seen, state))
    summary = RequestPrefill(
        request_id=request_id,
        num_layers=len(layers),
        num_kv_heads=cache.num_kv_heads if shard is None else shard.total,
        num_q_heads=num_q_heads,
        length=length,
        shard=shard,
    )
    plan = policy.plan(summary, results, state)
    if plan is None:
        return
    plan = workers_part(plan, shard)
    while True:
        try:
            cache.apply_keep_plan(request_id, plan, None if len(layers) == cache.num_layers else layers)
            return
        except PoolExhaustedError:  # raised before anything changed
            if make_room is None or not make_room():
                raise


def evict_after_decode(
    cache: PagedKVCache,
    request_id: str,
    policy: KVPolicy,
    state: dict[str, Any],
    position: int,
    attention: Callable[[int, int], torch.Tensor | None],
) -> None:
    """The decode-time policy's eviction after the token at `position`; `attention(layer, n)` is the step's
    attention over the layer's first `n` entries `[Hkv, G, n]` (None when the policy does not ask for it).
    The policy sees the global layers only, numbered as at prefill."""
    model_layers = cache.global_layers
    if model_layers.numel() == 0:
        return
    positions, lengths = cache.entry_positions(request_id)
    layers = [
        DecodeLayer(positions=positions[layer], lengths=lengths[layer], attention=attention(layer, positions.shape[-1]))
        for layer in model_layers.tolist()
    ]
    eviction = policy.on_decode_step(DecodeStep(request_id, position, layers), state)
    if eviction is not None and eviction.entries.numel():
        rows = torch.full_like(eviction.entries, cache.row_of(request_id))
        evicted_layers = model_layers[torch.as_tensor(eviction.layers, dtype=torch.int64)]
        cache.evict(rows, evicted_layers, eviction.heads, eviction.entries)
