"""Where a request's cache row starts from: the argument of `ModelRunner.start`, the one way a request is seated.

A driver chooses the origin; the runner alone gives the request its row and the state that goes with it (progress,
policy state, capture, prefix lease, KV figures), so every way in sets the same fields the same way:

- `Prefill`: a row of its own, prefilled from token 0. A new request, or a preempted one that recomputes its prompt
  and the output its driver kept (the driver restores `output_token_ids` first);
- `ForkOf`: another sample of a prompt, on a fork of the first sample's row, with its state after the prompt;
- `MatchedPrefix`: the stored prefix the store matches to the prompt (automatic matching, `engine/prefix_store.py`);
- `LeasedPrefix`: the first `length` tokens of a stored prefix that a driver chose and leased (vLLM's scheduler
  decides what a request reads; the plugin's worker follows it);
- `LoadedEntries`: K/V computed elsewhere as the prompt's first entries (a shared prefix's copy, `engine/prefix.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm_kvpress_ext.engine.prefix_store import PrefixLease
    from vllm_kvpress_ext.engine.request import Request
    from vllm_kvpress_ext.policies.capture import PrefillCapture


@dataclass(frozen=True)
class Prefill:
    """A row of its own; the prefill starts at token 0."""


@dataclass(frozen=True)
class ForkOf:
    """A fork of `parent`'s row (another sample of its prompt), after its prompt."""

    parent: Request


@dataclass(frozen=True)
class MatchedPrefix:
    """The stored prefix that the store matches to the request's tokens, if one does. The request then runs the
    rest of its prompt from that row, exactly as it would right after compressing the prefix itself."""


@dataclass(frozen=True)
class LeasedPrefix:
    """The first `length` tokens of the stored prefix held by `lease`. The lease passes to the request, or is
    released where it cannot be used."""

    lease: PrefixLease
    length: int


@dataclass(frozen=True)
class LoadedEntries:
    """`keys` / `values` (`[L, H, n, d]`) as the first n prompt entries, and `capture` as what their prefill recorded.
    The caller has checked that the pool has the pages."""

    keys: torch.Tensor
    values: torch.Tensor
    capture: PrefillCapture | None


Origin = Prefill | ForkOf | MatchedPrefix | LeasedPrefix | LoadedEntries
PREFILL = Prefill()
