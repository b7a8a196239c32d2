"""The engine's `AttentionContext`: writes each layer's new K/V into the paged cache and attends.

One context serves one engine step, which is either a prefill step (chunks of one or more
requests, each attending to its cached prefix and itself) or a decode step (one token for each
of a batch of requests, attending over their ragged per-head caches).

A prefill segment normally arrives with its slots for every layer already allocated. A segment
with `layerwise` set (the last chunk of a request whose policy compresses layer by layer) instead
asks for each layer's slots when the forward pass reaches that layer and hands the layer back for
compression right after its attention, so the next layer allocates from a pool that already got
the dropped pages back.

A sliding-window layer's cache is a ring of its window (`PagedKVCache`): a chunk's tokens overwrite
entries its own first queries still read. Its prefill therefore reads the ring before writing, and
attends over the ring's entries and the chunk's keys together under the window. Its decode needs
nothing special: the ring holds exactly the keys the new token reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from vllm_kvpress_ext.attention import (
    causal_attention,
    causal_attention_with_lse,
    gated_chunk_attention,
    paged_decode_attention,
    paged_prefill_attention,
    ring_chunk_attention,
)
from vllm_kvpress_ext.cache import PagedKVCache
from vllm_kvpress_ext.engine.admission import PromptAdmission
from vllm_kvpress_ext.policies.base import Admission
from vllm_kvpress_ext.policies.capture import PrefillCapture


class LayerwisePrefill(Protocol):
    """Per-layer allocation and compression of one segment (implemented by the engine)."""

    def slots(self, layer: int) -> torch.Tensor | None:
        """Allocate the segment's slots in `layer` now; `[Hkv, n]` flat slot ids, None if the request failed."""
        ...

    def compress(self, layer: int) -> None:
        """`layer` is written, attended and captured: compress it (and maybe earlier layers)."""
        ...


@dataclass
class PrefillSegment:
    """Tokens [start, end) of one request in a prefill step, at [offset, offset + end - start) of the batch."""

    row: int
    start: int
    end: int
    offset: int
    slots: torch.Tensor | None  # [L, 1, H, n] from `append_slots`; None when `layerwise` allocates per layer
    capture: PrefillCapture | None = None
    admission: PromptAdmission | None = None  # a write-gated request's flags so far (WG-KV)
    layerwise: LayerwisePrefill | None = None

    @property
    def length(self) -> int:
        return self.end - self.start


class PrefillContext:
    def __init__(self, cache: PagedKVCache, segments: list[PrefillSegment], positions: torch.Tensor, scale: float):
        self.cache = cache
        self.segments = segments
        self.positions = positions
        self.scale = scale
        self.windows = cache.layer_windows.tolist()

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
        out = torch.empty_like(q)
        for seg in self.segments:
            sl = slice(seg.offset, seg.offset + seg.length)
            if seg.layerwise is not None:
                slots = seg.layerwise.slots(layer_idx)
                if slots is None:
                    # This request failed its layer-wise prefill (it is dropped after the pass): it gets no
                    # pages, and an output over its own chunk only keeps the batch's pass going.
                    out[sl] = causal_attention(q[sl][None], k[sl][None], v[sl][None], self.scale)[0]
                    continue
            else:
                assert seg.slots is not None
                slots = seg.slots[layer_idx, 0]
            window = self.windows[layer_idx]
            if window:  # no policy reads a sliding layer, so nothing of it is captured
                out[sl] = self._sliding(seg, layer_idx, slots, q[sl], k[sl], v[sl], window)
                continue
            cache.write(slots.transpose(0, 1), k[sl], v[sl])
            # Where the capture asks for the queries' log-sum-exps, the attention below yields them (free on a
            # CPU's flash attention and in the chunked path); the gated path leaves them missing.
            lse: torch.Tensor | None = None
            want_lse = seg.capture is not None and seg.capture.spec.query_lse
            if seg.admission is not None and self._gated(seg, layer_idx, q[sl], k[sl], v[sl], k_pre_rope[sl], out[sl]):
                pass
            elif seg.start == 0 and want_lse:
                attended, lse = causal_attention_with_lse(q[sl][None], k[sl][None], v[sl][None], self.scale)
                out[sl] = attended[0]
                lse = None if lse is None else lse[0]
            elif seg.start == 0:
                out[sl] = causal_attention(q[sl][None], k[sl][None], v[sl][None], self.scale)[0]
            else:
                lse_out: list[torch.Tensor] | None = [] if want_lse else None
                out[sl] = paged_prefill_attention(
                    q[sl],
                    self.positions[sl],
                    cache.pool.kv,
                    cache.pool.positions,
                    cache.device_block_tables[layer_idx, seg.row],
                    cache.device_seq_lens[layer_idx, seg.row],
                    self.scale,
                    lse_out=lse_out,
                )
                lse = lse_out[0] if lse_out else None
            if seg.capture is not None:
                seg.capture.record(layer_idx, self.positions[sl], hidden[sl], q[sl], k[sl], k_pre_rope[sl], lse)
            if seg.layerwise is not None:
                seg.layerwise.compress(layer_idx)
        return out

    def _sliding(
        self,
        seg: PrefillSegment,
        layer_idx: int,
        slots: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int,
    ) -> torch.Tensor:
        """A sliding-window layer's chunk: attend over the ring and the chunk, then write the chunk into the ring."""
        cache = self.cache
        positions = self.positions[seg.offset : seg.offset + seg.length]
        table = cache.device_block_tables[layer_idx, seg.row]
        out = ring_chunk_attention(
            cache.pool.kv, cache.pool.positions, table, seg.start, q, positions, k, v, window, self.scale
        )
        cache.write(slots.transpose(0, 1), k, v)
        return out

    def _gated(
        self,
        seg: PrefillSegment,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pre_rope: torch.Tensor,
        out: torch.Tensor,
    ) -> bool:
        """Write-gated prefill: record the chunk's admission flags, attend under the vertical-slash mask.

        Returns False (the caller runs plain causal attention) when the mask is causal anyway: the whole
        prompt so far fits in the local window, or every token so far is admitted.
        """
        assert seg.admission is not None
        admitted = seg.admission.gate(layer_idx, k_pre_rope, k)
        cache = self.cache
        attended = gated_chunk_attention(
            cache.pool.kv,
            cache.pool.positions,
            cache.device_block_tables[layer_idx, seg.row],
            cache.device_seq_lens[layer_idx, seg.row],
            q,
            k,
            v,
            admitted,
            seg.admission.window,
            self.scale,
            seg.start,
        )
        if attended is None:
            return False
        out.copy_(attended)
        return True


class DecodeContext:
    def __init__(
        self,
        cache: PagedKVCache,
        rows: torch.Tensor,
        slots: torch.Tensor,
        scale: float,
        want_probs: bool,
        admissions: list[tuple[torch.Tensor, Admission]] | None = None,
    ):
        self.cache = cache
        # (batch indices, admission) of the rows whose policy gates writes: each new token's flags are set
        # as it enters the ring, so the ring knows whether to promote it when it is overwritten.
        self.admissions = admissions or []
        # Per layer `[B, Hkv, G, N]` attention over each row's global entries, for decode-time policies.
        self.probs: list[torch.Tensor] | None = [] if want_probs else None
        self.rows = rows
        self.device_rows = rows.to(cache.device)
        self.slots = slots  # [L, B, H, 1]
        self.scale = scale
        self.has_ring = bool((cache.rings.window[rows] > 0).any())
        self.windows = cache.layer_windows.tolist()
        self._host_probs: dict[int, torch.Tensor] = {}

    def host_probs(self, layer_idx: int) -> torch.Tensor:
        """Layer `layer_idx`'s decode attention `[B, Hkv, G, N]` on the host, copied once for the whole batch.

        Decode-time policies read their own row of every layer after the step; one copy per layer and
        step (rather than one per layer, request and step) keeps the device synchronisations at L per step.
        """
        assert self.probs is not None
        if layer_idx not in self._host_probs:
            self._host_probs[layer_idx] = self.probs[layer_idx].cpu()
        return self._host_probs[layer_idx]

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
        cache.write(self.slots[layer_idx, :, :, 0], k, v)
        # A sliding-window layer has no local ring (its own ring holds its window): nothing to admit or read there.
        ringed = self.has_ring and not self.windows[layer_idx]
        for index, admission in self.admissions if ringed else ():
            local = index.to(k.device)
            cache.rings.admit(layer_idx, self.rows[index], admission.flags(layer_idx, k_pre_rope[local], k[local]))
        ring_tables = cache.rings.device_tables[layer_idx] if ringed else None
        ring_lens = cache.rings.lens().to(cache.device) if ringed else None
        return paged_decode_attention(
            q,
            cache.pool.kv,
            cache.pool.positions,
            cache.device_block_tables[layer_idx],
            cache.device_seq_lens[layer_idx],
            self.device_rows,
            self.scale,
            ring_tables,
            ring_lens,
            self.probs,
        )
