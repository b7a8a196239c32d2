"""Layer-wise prefill compression of one request, inside the forward pass of its last prefill chunk."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from vllm_kvpress_ext.cache import KeepPlan, PagedKVCache
from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.policies.base import AdmissionPolicy, LayerKeep, LayerPrefill, RequestPrefill, full_prompt_pages


def _ceil_div(x: int, d: int) -> int:
    return -(-x // d)


class PrefillPeakExceededError(RuntimeError):
    """A layer-wise prefill needed more pages than its policy declared (`KVPolicy.prefill_peak_pages`)."""


def prefill_reservation(
    policy: KVPolicy | None,
    length: int,
    whole_prompt: bool,
    num_layers: int,
    num_kv_heads: int,
    page_size: int,
    gated: bool = False,
    chunk_tokens: int | None = None,
) -> int:
    """Pages a scheduler reserves for a prefill of `length` entries; the engine holds the request to it.

    The full prompt in every layer and head, unless
    - the policy admits during a chunked prefill (WG-KV) and the scheduler's chunks are at most
      `chunk_tokens` tokens: then the policy's `chunked_prefill_peak_pages`;
    - the prefill compresses layer by layer in one chunk (`whole_prompt`: the first chunk is the whole
      prefill; a write-gated request never does): then the policy's declared `prefill_peak_pages`.
    Either is capped at the full prompt. A declaration that raises counts as the full prompt, and the
    request's own prefill will report the error.
    """
    full = full_prompt_pages(length, num_layers, num_kv_heads, page_size)
    if isinstance(policy, AdmissionPolicy) and chunk_tokens is not None:
        try:
            declared = int(policy.chunked_prefill_peak_pages(length, num_layers, num_kv_heads, page_size, chunk_tokens))
        except Exception:
            return full
        return max(0, min(full, declared))
    if policy is None or gated or not whole_prompt or not policy.compresses_layerwise:
        return full
    try:
        declared = int(policy.prefill_peak_pages(length, num_layers, num_kv_heads, page_size))
    except Exception:
        return full
    return max(0, min(full, declared))


class LayerwiseCompression:
    """Layer-wise prefill compression of one request, during the forward pass of its last prefill chunk.

    The attention context asks for layer l's slots when the forward pass reaches layer l (earlier
    chunks already hold the prefix in every layer; this chunk's pages are allocated here, one layer
    at a time) and calls `compress(l)` right after layer l's attention: the policy scores the layer
    (`on_layer_prefilled`, with exactly what end-of-prefill compression would see: every prompt
    entry of the layer and its captures), `plan_layer` returns keep masks, and the cache compacts
    those layers at once, returning their pages before layer l + 1 allocates. No later layer
    reads layer l's cache, so hidden states and logits are those of the ordinary path.

    The request never holds more than `reserved` pages (`prefill_reservation`: the policy's declared
    peak for a one-chunk prefill, the full prompt otherwise), which is what its scheduler set aside. A
    policy that raises, or a layer whose pages would pass the reservation (the declaration was wrong),
    does not stop the batch's forward pass: the error is kept in `error`, the remaining layers of this
    request get no pages (`slots` returns None; nothing is written for them and their attention output
    is discarded), and the runner fails this request alone once the pass is over, freeing its pages.
    Other requests never see a page they were promised taken.

    Shared by the embedded engine's runner and the plugin on vLLM's runner (`vllm_plugin/native/`): each
    gives the request's cache row and how it shows a policy one layer (`layer_prefill`). The policy's
    state is `state`; `seconds` is the time the policy took.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        policy: KVPolicy,
        request_id: Hashable,
        row: int,
        start: int,
        end: int,
        num_q_heads: int,
        layer_prefill: Callable[[int], LayerPrefill],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cache = cache
        self.policy = policy
        self.request_id = request_id
        self.row = row
        self.layer_prefill = layer_prefill
        self.clock = clock
        self.positions = torch.arange(start, end)
        self.state: dict[str, Any] = {}
        self.summary = RequestPrefill(
            request_id=str(request_id),
            num_layers=cache.num_layers,
            num_kv_heads=cache.num_kv_heads,
            num_q_heads=num_q_heads,
            length=end,
        )
        self.results: list[Any] = []
        # Per layer, which prompt entries it still holds ([H, n]; None while it holds them all): how the
        # policy's masks over prompt entries map onto the layer's current (compacted) entries.
        self.kept_masks: list[torch.Tensor | None] = [None] * cache.num_layers
        self.seconds = 0.0
        self.error: Exception | None = None
        self.start, self.end = start, end
        self.reserved = prefill_reservation(
            policy, end, start == 0, cache.num_layers, cache.num_kv_heads, cache.page_size
        )

    def slots(self, layer: int) -> torch.Tensor | None:
        """This chunk's slots in `layer`, or None once this request failed or would pass its reservation."""
        if self.error is not None:
            return None
        cache = self.cache
        held = int(cache.pages_per_head(self.request_id).sum())
        ps, heads = cache.page_size, cache.num_kv_heads
        # Layer `layer` holds the earlier chunks' `start` entries per head and grows to `end`.
        new_pages = heads * (_ceil_div(self.end, ps) - _ceil_div(self.start, ps))
        if held + new_pages > self.reserved:
            self.error = PrefillPeakExceededError(
                f"layer {layer} needs {new_pages} more pages on top of {held} held, past the {self.reserved} "
                f"reserved for this prefill ({type(self.policy).__name__}.prefill_peak_pages is too low)"
            )
            return None
        return cache.append_layer_slots(layer, self.row, self.positions)

    def compress(self, layer: int) -> None:
        if self.error is not None:
            return
        start = self.clock()
        try:
            prefill = self.layer_prefill(layer)
            self.results.append(self.policy.on_layer_prefilled(prefill, self.state))
            keep = self.policy.plan_layer(self.summary, layer, self.results, self.state)
            if keep is not None:
                self._apply(keep, layer)
        except Exception as exc:
            self.error = exc
        self.seconds += self.clock() - start

    def _apply(self, keep: LayerKeep, layer: int) -> None:
        """Compact the layers of `keep`; its masks are over prompt entries, the cache wants current entries."""
        if not keep.layers:
            return
        heads, n = self.summary.num_kv_heads, self.summary.length
        masks = keep.masks.cpu()
        if masks.dtype != torch.bool or masks.shape != (len(keep.layers), heads, n):
            raise ValueError(
                f"plan_layer must return bool masks [{len(keep.layers)}, {heads}, {n}], "
                f"got {masks.dtype} {tuple(masks.shape)}"
            )
        if any(not 0 <= m <= layer for m in keep.layers):
            raise ValueError(f"plan_layer after layer {layer} may only cover layers 0..{layer}, got {keep.layers}")
        relative = []
        for m, mask in zip(keep.layers, masks, strict=True):
            kept_before = self.kept_masks[m]
            if kept_before is None:
                relative.append(mask)
            else:
                if bool((mask & ~kept_before).any()):
                    raise ValueError(f"plan_layer re-planned layer {m} with entries it had already dropped")
                # Entry e of the prompt now sits at index (number of entries kept before it) of its head.
                h_idx, e_idx = kept_before.nonzero(as_tuple=True)
                current = torch.zeros(heads, n, dtype=torch.bool)
                current[h_idx, (kept_before.cumsum(-1) - 1)[h_idx, e_idx]] = mask[h_idx, e_idx]
                relative.append(current)
            self.kept_masks[m] = mask
        plan = KeepPlan.from_mask(torch.stack(relative))
        self.cache.apply_keep_plan(self.request_id, plan, layers=list(keep.layers))
