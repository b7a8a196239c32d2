"""`KeptEntries`: which token positions each (layer, KV head) of a request held, read from the cache."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from vllm_kvpress_ext.cache import PagedKVCache


@dataclass(frozen=True)
class KeptEntries:
    """The entries a request held in the cache at one moment: right after its policy compressed, or when it
    finished (just before its pages were released).

    `positions[l, h, :lengths[l, h]]` are the global region's token positions of layer l, KV head h in
    storage order (compaction keeps order; decode-time eviction does not), padded with -1: exactly what
    `PagedKVCache.entry_positions` returns. Requests with a local ring (WG-KV) also hold
    `ring_positions[l, h]`, the same recent tokens for every head (-1 in a sliding-window layer, which has no
    local ring); without a ring its last dimension is 0.
    Positions count from the first prompt token, so with `compress_after = c` the entries below c are
    what the policy kept of the context and the rest are the question and the answer.
    """

    positions: torch.Tensor  # [L, H, N] int64, -1 as padding
    lengths: torch.Tensor  # [L, H] int64
    ring_positions: torch.Tensor  # [L, H, R] int64

    @property
    def counts(self) -> torch.Tensor:
        """Entries held per (layer, KV head) `[L, H]`, ring included (equals `KVStats.kept_per_head`)."""
        return self.lengths + (self.ring_positions >= 0).sum(-1)

    @property
    def per_layer(self) -> list[int]:
        """Entries held by each layer, summed over its KV heads."""
        return [int(n) for n in self.counts.sum(-1)]

    @property
    def total(self) -> int:
        """Entries held over every (layer, KV head) (equals `KVStats.tokens_kept`)."""
        return int(self.counts.sum())

    def head(self, layer: int, head: int) -> list[int]:
        """Sorted positions held by one (layer, KV head), ring included."""
        held = self.positions[layer, head, : int(self.lengths[layer, head])]
        ring = self.ring_positions[layer, head]
        return sorted(torch.cat([held, ring[ring >= 0]]).tolist())

    def mask(self, length: int) -> torch.Tensor:
        """`[L, H, length]` booleans: whether each (layer, KV head) holds position p, for p < length."""
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            raise ValueError(f"length must be an integer >= 0, got {length!r}")
        positions = torch.cat([self.positions, self.ring_positions], dim=-1)
        # Padding and positions past `length` land in one spare column, dropped after the scatter.
        slots = torch.where((positions >= 0) & (positions < length), positions, length)
        held = torch.zeros(*positions.shape[:2], length + 1, dtype=torch.bool)
        held.scatter_(-1, slots, True)
        return held[..., :length]


def kept_entries(cache: PagedKVCache, request_id: Hashable) -> KeptEntries:
    """What `request_id` holds in `cache` now (it must still hold its cache row)."""
    positions, lengths = cache.entry_positions(request_id)
    return KeptEntries(positions=positions, lengths=lengths, ring_positions=cache.ring_positions(request_id))
