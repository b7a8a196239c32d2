"""Keep plans: which entries of each (layer, KV head) survive a compression.

A plan is stored padded: `indices[L, H, K]` with `lengths[L, H]` valid entries per row, each
row strictly increasing (sorted, no duplicates). Policies usually produce a boolean mask, so
`KeepPlan.from_mask` is the common constructor; `from_lists` serves tests and hand-written plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class InvalidPlanError(ValueError):
    """A keep plan or eviction request does not fit the cache; the cache was left unchanged."""


@dataclass(frozen=True)
class KeepPlan:
    """Sorted keep indices per (layer, KV head), padded with -1 past `lengths`."""

    indices: torch.Tensor  # int64 [L, H, K]
    lengths: torch.Tensor  # int64 [L, H]

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> KeepPlan:
        """`mask[L, H, n]` is True where the entry is kept."""
        if mask.dim() != 3 or mask.dtype != torch.bool:
            raise InvalidPlanError(f"keep mask must be a bool tensor [L, H, n], got {mask.dtype} {tuple(mask.shape)}")
        mask = mask.cpu()
        lengths = mask.sum(dim=-1)
        width = int(lengths.max()) if lengths.numel() else 0
        # Sorting the mask descending with a stable sort lists kept indices first, in order.
        order = torch.sort(mask.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :width]
        valid = torch.arange(width) < lengths.unsqueeze(-1)
        indices = torch.where(valid, order, torch.full_like(order, -1))
        return cls(indices=indices, lengths=lengths)

    @classmethod
    def from_lists(cls, per_layer: Sequence[Sequence[Sequence[int] | torch.Tensor]]) -> KeepPlan:
        """`per_layer[l][h]` lists the kept entry indices of (l, h)."""
        num_layers = len(per_layer)
        if num_layers == 0:
            raise InvalidPlanError("keep plan has no layers")
        num_heads = len(per_layer[0])
        if any(len(heads) != num_heads for heads in per_layer):
            raise InvalidPlanError("keep plan layers have different numbers of heads")
        rows = [
            torch.as_tensor(list(idx) if not isinstance(idx, torch.Tensor) else idx, dtype=torch.int64)
            for heads in per_layer
            for idx in heads
        ]
        if any(row.dim() != 1 for row in rows):
            raise InvalidPlanError("each (layer, head) of a keep plan must be a 1-D list of indices")
        width = max((row.numel() for row in rows), default=0)
        indices = torch.full((num_layers * num_heads, width), -1, dtype=torch.int64)
        for i, row in enumerate(rows):
            indices[i, : row.numel()] = row
        lengths = torch.tensor([row.numel() for row in rows], dtype=torch.int64)
        return cls(indices.view(num_layers, num_heads, width), lengths.view(num_layers, num_heads))

    def heads(self, first: int, count: int) -> KeepPlan:
        """The plan of heads [first, first + count) only (a tensor-parallel worker's part of a plan over all)."""
        lengths = self.lengths[:, first : first + count]
        width = int(lengths.max()) if lengths.numel() else 0
        indices = self.indices[:, first : first + count, :width]
        return KeepPlan(indices=indices.contiguous(), lengths=lengths.contiguous())

    def layers(self, first: int, count: int) -> KeepPlan:
        """The plan of layers [first, first + count) only (a pipeline stage's part of a plan over all)."""
        if first < 0 or first + count > self.lengths.shape[0]:
            raise InvalidPlanError(f"keep plan has {self.lengths.shape[0]} layers, not [{first}, {first + count})")
        lengths = self.lengths[first : first + count]
        width = int(lengths.max()) if lengths.numel() else 0
        indices = self.indices[first : first + count, :, :width]
        return KeepPlan(indices=indices.contiguous(), lengths=lengths.contiguous())

    def to_mask(self, current_lengths: torch.Tensor) -> torch.Tensor:
        """Validate against the current lengths `[L, H]` and return the keep mask `[L, H, max_len]`.

        Raises InvalidPlanError naming the first offending (layer, head).
        """
        current_lengths = current_lengths.to(torch.int64).cpu()
        if self.indices.dim() != 3 or self.lengths.shape != self.indices.shape[:2]:
            raise InvalidPlanError(
                f"keep plan indices must be [L, H, K] with lengths [L, H]; got {tuple(self.indices.shape)} "
                f"and {tuple(self.lengths.shape)}"
            )
        if self.lengths.shape != current_lengths.shape:
            raise InvalidPlanError(
                f"keep plan covers {tuple(self.lengths.shape)} (layers, heads) but the request has "
                f"{tuple(current_lengths.shape)}"
            )
        width = self.indices.shape[-1]
        if bool((self.lengths < 0).any()) or bool((self.lengths > width).any()):
            raise InvalidPlanError("keep plan lengths must lie in [0, K]")
        valid = torch.arange(width) < self.lengths.unsqueeze(-1)
        idx = self.indices
        bad_range = valid & ((idx < 0) | (idx >= current_lengths.unsqueeze(-1)))
        if bool(bad_range.any()):
            layer, head, pos = (int(v) for v in bad_range.nonzero()[0])
            raise InvalidPlanError(
                f"keep index {int(idx[layer, head, pos])} out of range for layer {layer} head {head} "
                f"(length {int(current_lengths[layer, head])})"
            )
        if width > 1:
            both_valid = valid[..., 1:]
            not_increasing = both_valid & (idx[..., 1:] <= idx[..., :-1])
            if bool(not_increasing.any()):
                layer, head, pos = (int(v) for v in not_increasing.nonzero()[0])
                kind = "duplicate" if int(idx[layer, head, pos + 1]) == int(idx[layer, head, pos]) else "unsorted"
                raise InvalidPlanError(f"{kind} keep indices for layer {layer} head {head} at position {pos + 1}")
        max_len = int(current_lengths.max()) if current_lengths.numel() else 0
        mask = torch.zeros(*current_lengths.shape, max_len + 1, dtype=torch.bool)
        # Padding points at the scratch column max_len, dropped below.
        target = torch.where(valid, idx, torch.full_like(idx, max_len))
        mask.scatter_(-1, target, True)
        return mask[..., :max_len]
