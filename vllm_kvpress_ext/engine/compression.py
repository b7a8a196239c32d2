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
from dataclasses import dataclass
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
    numbering: tuple[int, int] | None = None,
) -> LayerPrefill:
    """What a policy sees of one layer after prefill: the entries it holds and what the pass captured.

    `gated` (WG-KV admission) passes every head's own positions: heads hold different entries. Where `model`
    is not the project's, `rotary` is the model's RoPE and `queries_from_hidden` the layer's query projection.
    `numbering` (the layer's index among the compressed layers, and their number) stands for this cache's own
    where it holds some of the model's layers (a pipeline stage).
    """
    keys, values, positions, _ = cache.gather_layer(request_id, layer)
    compressed = cache.global_layers.tolist()
    if layer not in compressed:
        raise ValueError(f"layer {layer} slides over a window: no policy compresses it")
    index, total = numbering if numbering is not None else (compressed.index(layer), len(compressed))
    return LayerPrefill(
        layer=index,
        num_layers=total,
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


@dataclass(frozen=True)
class StageRelay:
    """Pipeline stages, each holding consecutive layers of the model, for a policy that decides across layers.

    `total` is the number of compressed layers over every stage. `relay(work)` runs `work` on each stage in turn,
    giving it what the stage before returned (None on the first), and returns on every stage what the last
    stage's `work` returned (`vllm_plugin/native/tensor_parallel.relay_stages`)."""

    total: int
    relay: Callable[[Callable[[Any], Any]], Any]


@dataclass(frozen=True)
class StageFailure:
    """What a stage relays when the policy raised there: the stages after it skip their part."""

    message: str


def relay_failing_alike(relay: Callable[[Callable[[Any], Any]], Any], work: Callable[[Any], Any], what: str) -> Any:
    """`relay(work)` over the pipeline stages, where `work` raising on one stage fails every stage alike: the failure
    is relayed in place of the stage's result, the later stages pass it on without working, and each stage then
    raises it (so that no stage waits for a result that will not come)."""

    def guarded(carried: Any) -> Any:
        if isinstance(carried, StageFailure):
            return carried
        try:
            return work(carried)
        except Exception as exc:
            return StageFailure(f"{type(exc).__name__}: {exc}")

    result = relay(guarded)
    if isinstance(result, StageFailure):
        raise RuntimeError(f"{what} failed on a pipeline stage: {result.message}")
    return result


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
    stages: StageRelay | None = None,
) -> None:
    """Score every layer, plan, compact the request's cache to the plan (`state` is the policy's, kept
    for its decode steps). `rotary` and `query_projections` (per layer) stand in for `model`'s where the
    model is not the project's; `shard` is this worker's heads under tensor parallelism. A compaction that
    moves kept entries into pages the row shares (an exact cached prefix) copies those pages first; where the
    pool has no room for the copies, `make_room` frees some (False: nothing left to free) and the compaction
    is tried again. With `stages`, the policy sees this stage's layers after the earlier stages' and plans on the
    last (`plan_stage_by_stage`)."""
    layers = cache.global_layers.tolist()
    if not layers and stages is None:
        return  # every layer slides (Mistral 7B v0.1): each already holds no more than its window

    def seen(layer: int, numbering: tuple[int, int] | None = None) -> LayerPrefill:
        project = query_projections[layer] if query_projections is not None else None
        return layer_prefill(cache, request_id, layer, capture, model, scale, gated, rotary, project, shard, numbering)

    def summary(num_layers: int) -> RequestPrefill:
        num_kv_heads = cache.num_kv_heads if shard is None else shard.total
        return RequestPrefill(request_id, num_layers, num_kv_heads, num_q_heads, length, shard)

    if stages is None:
        results = [policy.on_layer_prefilled(seen(layer), state) for layer in layers]
        plan = policy.plan(summary(len(layers)), results, state)
    else:
        plan, before = plan_stage_by_stage(policy, stages, layers, seen, summary, state)
        plan = None if plan is None else plan.layers(before, len(layers))
    if plan is None or not layers:
        return
    plan = workers_part(plan, shard)
    while True:
        try:
            cache.apply_keep_plan(request_id, plan, None if len(layers) == cache.num_layers else layers)
            return
        except PoolExhaustedError:  # raised before anything changed
            if make_room is None or not make_room():
                raise


def plan_stage_by_stage(
    policy: KVPolicy,
    stages: StageRelay,
    layers: list[int],
    seen: Callable[[int, tuple[int, int]], LayerPrefill],
    summary: Callable[[int], RequestPrefill],
    state: dict[str, Any],
) -> tuple[KeepPlan | None, int]:
    """A policy that decides across layers, over pipeline stages that each hold some of the layers: each stage
    continues the policy's pass over the layers (`on_layer_prefilled`, in layer order, with the state and the
    results of the stages before it), and the last one plans for every layer, as one worker would. Returns that
    plan (over all compressed layers) and how many of them precede this stage's."""
    before = 0

    def work(carried: Any) -> Any:
        nonlocal before
        earlier_state, results = carried if carried is not None else ({}, [])
        before = len(results)
        state.clear()
        state.update(earlier_state)
        for index, layer in enumerate(layers):
            results.append(policy.on_layer_prefilled(seen(layer, (before + index, stages.total)), state))
        if len(results) < stages.total:  # a later stage holds the rest
            return state, results
        return policy.plan(summary(stages.total), results, state)

    plan = relay_failing_alike(stages.relay, work, "the policy")
    if plan is not None and not isinstance(plan, KeepPlan):
        raise RuntimeError(f"the last pipeline stage planned {type(plan).__name__}, not a keep plan")
    return plan, before


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
