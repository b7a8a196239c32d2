"""Write-time admission (WG-KV) of a request's prompt: binding its gates, what they said, and the cache steps.

Shared by the embedded engine's runner and the plugin on vLLM's runner (`vllm_plugin/native/`), so both
admit, drop and ring exactly the same entries:

- `bind_admission`: the policy's write gate bound to the model, checked against the model and the pool;
- `PromptAdmission`: per request, the flags (and, where the policy ranks by them, the gate values) of
  every prompt token so far, per layer, recorded chunk by chunk as the forward pass writes the keys;
- after a chunk that does not end the prompt, `PromptAdmission.drop_unadmitted` leaves each head only
  its admitted entries and the last window; at prefill completion `PromptAdmission.start_ring` moves
  the last window into the local ring. The attention of a gated chunk is
  `attention.gated_chunk_attention`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.cache import PagedKVCache
from vllm_kvpress_ext.engine.request import RequestRejectedError
from vllm_kvpress_ext.models.write_gate import GateStore
from vllm_kvpress_ext.policies.base import Admission, AdmissionPolicy, HeadShard, KVPolicy


def bind_admission(
    policy: KVPolicy | None,
    cache: PagedKVCache,
    model_path: str | Path,
    device: torch.device,
    gate_store: GateStore | None = None,
    max_entries: int | None = None,
    shard: HeadShard | None = None,
    stage: tuple[int, int] | None = None,
) -> Admission | None:
    """The policy's write gate bound to this model (checked against it and the pool), or None.

    With `max_entries` (the most entries the request can ever write), the ring never spans more than
    that, rounded up to whole pages: a longer one would evict nothing more and only cost pages, so a
    request whose ring outlasts it holds what `full` holds. With `shard` (tensor parallelism), the gates of
    this worker's KV heads; with `stage` (pipeline parallelism: this pool's first layer among the model's
    layers, and their number), the gates of this stage's layers.
    """
    if cache.global_layers.numel() == 0:  # every layer slides: no layer is a policy's, the rings bound the cache
        return None
    admission = policy.admission(model_path, device, gate_store) if isinstance(policy, AdmissionPolicy) else None
    if admission is None:
        return None
    page = cache.page_size
    if max_entries is not None:
        longest = -(-max_entries // page) * page
        if admission.window > longest and dataclasses.is_dataclass(admission):
            admission = dataclasses.replace(admission, window=longest)
    gates = getattr(admission, "gates", None)
    if gates is not None and (shard is not None or stage is not None) and dataclasses.is_dataclass(admission):
        # A tensor-parallel worker's pool holds its KV heads, a pipeline stage's its layers: their gates, each as on
        # one worker.
        first_layer, num_layers = stage if stage is not None else (0, cache.num_layers)
        first_head, num_heads = (shard.first, shard.count) if shard is not None else (0, cache.num_kv_heads)
        gates.check_model(
            num_layers, shard.total if shard is not None else num_heads, cache.head_dim, "the write gates"
        )
        gates = gates.part(first_layer, cache.num_layers, first_head, num_heads)
        admission = dataclasses.replace(admission, gates=gates)
    if gates is not None:
        gates.check_model(cache.num_layers, cache.num_kv_heads, cache.head_dim, "the write gates")
    if admission.window < 1 or admission.window % page:
        raise ValueError(
            f"the local window ({admission.window} tokens) must be a positive multiple of the page size "
            f"({page}): the ring is made of whole pages"
        )
    # The local ring is in the global layers only: a sliding-window layer's own ring holds its window.
    ring_pages = cache.global_layers.numel() * cache.num_kv_heads * admission.window // page
    if ring_pages > cache.pool.num_pages:
        raise RequestRejectedError(
            f"the local window ({admission.window} tokens) needs {ring_pages} KV pages but the whole pool has "
            f"{cache.pool.num_pages}"
        )
    return admission


class PromptAdmission:
    """What a write-gated request's gates said of its prompt so far, per layer, in prompt order."""

    def __init__(self, admission: Admission, policy: AdmissionPolicy, num_layers: int) -> None:
        self.admission = admission
        self.policy = policy
        self.admitted: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]  # per layer, chunks of [H, n]
        # The gate values themselves, where the policy ranks the admitted entries by them (WG-KV with a cap).
        ranked = policy.wants_gate_values and hasattr(admission, "values")
        self.gate_values: list[list[torch.Tensor]] | None = [[] for _ in range(num_layers)] if ranked else None

    @property
    def window(self) -> int:
        return self.admission.window

    def gate(self, layer: int, k_pre_rope: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Gate a chunk's keys `[n, H, d]` (before and after RoPE) in `layer`; the flags `[H, end]` of every
        prompt token so far in that layer."""
        gated: Any = self.admission
        if self.gate_values is not None:
            values = gated.values(layer, k_pre_rope, k)
            self.gate_values[layer].append(values.transpose(0, 1))
            flags = values >= gated.tau
        else:
            flags = self.admission.flags(layer, k_pre_rope, k)
        self.admitted[layer].append(flags.transpose(0, 1))
        return torch.cat(self.admitted[layer], dim=-1)

    @staticmethod
    def _stacked(chunks: list[list[torch.Tensor]]) -> torch.Tensor:
        """`[L, H, n]` from per-layer chunks. A sliding-window layer is never gated (its own ring holds its
        window): it stands as all ones, every entry kept."""
        present = torch.cat(next(layer for layer in chunks if layer), dim=-1)
        return torch.stack([torch.cat(layer, dim=-1) if layer else torch.ones_like(present) for layer in chunks]).cpu()

    def drop_unadmitted(self, cache: PagedKVCache, request_id: Any) -> None:
        """Admission during a chunked prefill: what the gates did not admit leaves the cache with its chunk.

        After each chunk but the last, every head keeps only its admitted entries and the last W tokens
        (which the next chunk's band still reaches), so the prefill peak is about the admitted tokens plus
        one chunk and the window rather than the whole prompt. The next chunk's attention sees exactly
        the keys the whole prefix would show it, and `start_ring` ends with the cache the whole prompt
        would give. The policy may drop more admitted entries here (`limit_prefill_admission`).
        """
        device = next(layer for layer in self.admitted if layer)[0].device  # a gated (global) layer's
        admitted = self._stacked(self.admitted)
        values = self._stacked(self.gate_values) if self.gate_values is not None else None
        limited = self.policy.limit_prefill_admission(admitted, values, admitted.shape[-1] - self.window)
        if limited is not admitted:
            if limited.shape != admitted.shape or bool((limited & ~admitted).any()):
                raise ValueError("limit_prefill_admission may only drop admitted entries")
            # Later chunks' masks and `start_ring` must not see a dropped entry as admitted.
            admitted = limited
            self.admitted = [[flags.to(device)] for flags in admitted]
            if values is not None:
                self.gate_values = [[layer.to(device)] for layer in values]
        cache.drop_unadmitted(request_id, self.window, admitted)

    def start_ring(self, cache: PagedKVCache, request_id: Any) -> None:
        """Admission at prefill completion: the last W tokens into the ring, older ones kept only if admitted."""
        cache.start_ring(request_id, self.window, self._stacked(self.admitted))
