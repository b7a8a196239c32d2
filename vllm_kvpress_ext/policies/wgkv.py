"""`wgkv`: learned write-gate admission into a local ring + global cache, optionally under a hard cap.

Paper: "KV Admission: Learning What to Write for Efficient Long-Context Inference" (Write-Gated KV).
Gates (`models/write_gate.py`, trained by `kvpress train-gate`) score each key as it is written:
g_j in [0, 1] per (layer, KV head, token), admitted iff g_j >= tau.

    prefill:  M[i, j] = (j <= i) and (i - j < W_local  or  g_j >= tau)      vertical-slash attention
    cache:    the last W_local tokens -> each head's local ring, with their admission flags;
              older tokens -> the global region only if admitted (per head: global lengths differ)
    decode:   the new token enters the ring (its flag set from its own gate); the token it overwrites
              is promoted to the global region only if it was admitted (lazy promotion)

So each head holds exactly its admitted tokens plus the last W_local, and attention during decode
reads ring + global. With every gate = 1, or W_local >= the sequence, this is full attention.

Composition with eviction (the paper's Appendix K), on when `cap` is set: admission decides what is
written; a SnapKV-like score decides what is dropped when a layer's global region exceeds a hard
average cap of `cap` entries per KV head (ring excluded). At prefill the admitted entries are scored
by the observation window's attention (`observation_window` last queries, pooled as SnapKV does,
`count_include_pad` included) and cut to the cap at once; during decode every time a layer is over
its cap, the lowest-scoring `evict_fraction` (10%) of that layer's global entries, ranked across its
heads, are evicted. Each event counts as one eviction trigger (`counters["eviction_triggers"]` in
the request's KV stats).

Defaults: tau = 0.1 (the paper's threshold); W_local = 64 tokens (a multiple of the engine's page
size, since the ring is whole pages; the paper's models use longer windows for longer contexts, this
one fits the bundled 1-2K-token model) unless the gate file records the window it was trained with.

Divergences:
- Decode-time scores: SnapKV scores with the last w queries; past queries are not kept in the cache,
  so here each entry's score is an exponential moving average of the attention it receives, with
  rate 1 / observation_window (a soft window of the last w queries). An entry just promoted from the
  ring starts at this step's attention.
- The cap counts the global region only; the ring adds W_local entries per head on top.
- On a model with sliding-window layers (Gemma 2 and 3) the gates, the local ring and the cap apply to
  the global layers only: a sliding layer's own ring already holds just its window, so it admits
  every key it still reads. On a model whose every layer slides, WG-KV keeps what `full` keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_kvpress_ext.cache import KeepPlan
from vllm_kvpress_ext.models.write_gate import (
    GateStore,
    WriteGates,
    find_gates,
    gate_metadata,
    load_gates,
    shipped_gates,
)
from vllm_kvpress_ext.policies.base import (
    GQA_REDUCTIONS,
    AdmissionPolicy,
    DecodeEviction,
    DecodeStep,
    LayerPrefill,
    PolicyConfigError,
    RequestPrefill,
    check_choice,
    check_flag,
    pool_scores,
    reduce_group,
)
from vllm_kvpress_ext.policies.capture import CaptureSpec
from vllm_kvpress_ext.policies.h2o import realign, reduce_decode_attention
from vllm_kvpress_ext.policies.streaming_llm import evictions

DEFAULT_WINDOW = 64


@dataclass
class GateAdmission:
    """A bound write gate (an `Admission`): what the engine calls while writing keys."""

    gates: WriteGates
    tau: float
    window: int

    @torch.no_grad()
    def values(self, layer: int, k_pre_rope: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Gate values g `[n, H]` in [0, 1] for the keys `[n, H, d]` just written in `layer`."""
        return self.gates(layer, k_pre_rope, k)

    @torch.no_grad()
    def flags(self, layer: int, k_pre_rope: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Admission flags `[n, H]` (g >= tau) for the keys `[n, H, d]` just written in `layer`."""
        return self.values(layer, k_pre_rope, k) >= self.tau


@dataclass
class WGKVPolicy(AdmissionPolicy):
    """WG-KV; equations, defaults and divergences in the module docstring."""

    name = "wgkv"
    question_agnostic = True
    summary = "learned write-gate admission: local ring + global cache, lazy promotion (WG-KV)"

    file_fields = ("gates",)

    gates: str | None = None
    tau: float = 0.1
    local_window: int | None = None
    cap: int | None = None
    evict_fraction: float = 0.1
    observation_window: int = 32
    kernel_size: int = 5
    pooling: str = "avgpool"
    gqa_reduction: str = "mean"
    count_include_pad: bool = True

    def validate(self) -> None:
        if not 0.0 <= self.tau <= 1.0:
            raise PolicyConfigError(f"tau (admission threshold on g in [0, 1]) must lie in [0, 1], got {self.tau}")
        if self.local_window is not None and self.local_window < 1:
            raise PolicyConfigError(f"local_window must be >= 1, got {self.local_window}")
        if self.cap is not None and self.cap < 1:
            raise PolicyConfigError(f"cap (global entries per KV head, on average) must be >= 1, got {self.cap}")
        if not 0.0 < self.evict_fraction <= 1.0:
            raise PolicyConfigError(f"evict_fraction must lie in (0, 1], got {self.evict_fraction}")
        if self.observation_window < 1:
            raise PolicyConfigError(f"observation_window must be >= 1, got {self.observation_window}")
        if self.kernel_size < 1:
            raise PolicyConfigError(f"kernel_size must be >= 1, got {self.kernel_size}")
        check_choice("pooling", self.pooling, ("avgpool", "maxpool"))
        check_choice("gqa_reduction", self.gqa_reduction, GQA_REDUCTIONS)
        check_flag("count_include_pad", self.count_include_pad)

    def gate_path(self, model_dir: str | Path) -> Path:
        """`gates` as a path, or as the name of gates shipped in the package; by default `find_gates(model_dir)`."""
        if self.gates is None:
            return find_gates(model_dir)
        shipped = shipped_gates().get(self.gates)
        if shipped is not None and not Path(self.gates).exists():
            return shipped
        return Path(self.gates)

    def admission(
        self, model_dir: str | Path, device: torch.device, gate_store: GateStore | None = None
    ) -> GateAdmission:
        """The gates for `model_dir`, bound to this policy: from the caller's `gate_store`, or loaded afresh."""
        path = self.gate_path(model_dir)
        if not path.is_file():
            # No path in the message: it may be a client's request that asked for gates.
            raise PolicyConfigError(
                "wgkv: no write gates for this model (train them with `kvpress train-gate`, or name gates the "
                "server's operator allowed)"
            )
        gates = gate_store.get(path, device) if gate_store is not None else load_gates(path, device)
        window = self.local_window
        if window is None:
            window = int(gate_metadata(path).get("local_window", DEFAULT_WINDOW))
        return GateAdmission(gates=gates, tau=self.tau, window=window)

    # ------------------------------------------------------------------ prefill peak

    @property
    def wants_gate_values(self) -> bool:
        return self.cap is not None

    def limit_prefill_admission(
        self, admitted: torch.Tensor, values: torch.Tensor | None, window_start: int
    ) -> torch.Tensor:
        """With `cap`: a layer keeps at most `cap * H` admitted entries older than the window, the highest-gated.

        Ranked across the layer's heads, as the composition's eviction ranks; the SnapKV-like score
        needs the prompt's last queries, which do not exist yet in the middle of a prefill. An admission
        rule without gate values (`values` None) keeps the first admitted entries in (head, position) order.
        """
        if self.cap is None:
            return admitted
        if values is None:
            values = admitted.float()
        heads = admitted.shape[1]
        old = torch.arange(admitted.shape[-1], device=admitted.device) < window_start
        candidates = admitted & old
        kept = admitted.clone()
        for layer in range(admitted.shape[0]):
            if int(candidates[layer].sum()) > self.cap * heads:
                best = _top_across_heads(values[layer], candidates[layer], self.cap * heads)
                kept[layer] = admitted[layer] & (best | ~old)
        return kept

    def chunked_prefill_peak_pages(
        self, length: int, num_layers: int, num_kv_heads: int, page_size: int, chunk_tokens: int
    ) -> int:
        """With `cap` and `local_window` set: per layer, the capped admitted entries, each head's window and chunk.

        Between chunks a layer holds at most `cap * H` admitted entries older than the window (the
        engine drops the lowest-gated ones past it) plus the last W tokens of each head; a chunk adds
        at most `chunk_tokens` per head; `start_ring` never holds more (the ring takes W per head, the
        global region the capped entries plus the last chunk's admitted ones). Each head rounds its
        last page up. Without both fields the window (from the gate file) or the admitted count is
        unknown here, so the bound is the full prompt.
        """
        full = super().chunked_prefill_peak_pages(length, num_layers, num_kv_heads, page_size, chunk_tokens)
        if self.cap is None or self.local_window is None:
            return full
        # The whole window, even past a short prompt: the ring is allocated as W / page pages per head.
        entries = self.cap * num_kv_heads + num_kv_heads * (self.local_window + min(chunk_tokens, length))
        per_layer = (entries + num_kv_heads * (page_size - 1)) // page_size
        return min(full, num_layers * per_layer)

    # ------------------------------------------------------------------ composition with eviction

    def capture_spec(self) -> CaptureSpec:
        return CaptureSpec(window=self.observation_window) if self.cap is not None else CaptureSpec()

    def reusable_prefix(self, length: int) -> int:
        return 0  # the gates decide each prompt token's admission as its prefill writes it

    @property
    def wants_decode_steps(self) -> bool:
        return self.cap is not None

    @property
    def wants_decode_attention(self) -> bool:
        return self.cap is not None

    def on_layer_prefilled(self, layer: LayerPrefill, state: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """SnapKV scores `[H, N]` of the admitted global entries (after the ring has taken the last W_local)."""
        if self.cap is None:
            return None
        capture = layer.capture
        assert capture is not None and capture.queries is not None and capture.query_positions is not None
        positions = (
            layer.head_positions if layer.head_positions is not None else layer.positions.expand(layer.num_kv_heads, -1)
        )
        positions = positions.to(layer.keys.device)
        heads = layer.num_kv_heads
        if positions.shape[-1] == 0:  # the ring holds the whole prompt, or nothing older was admitted
            empty = torch.zeros(heads, 0)
            return {"scores": empty, "positions": empty.to(torch.int64)}
        group = capture.queries.shape[1] // heads
        keys = layer.keys.float().repeat_interleave(group, dim=0)  # [Hq, N, d]
        logits = torch.einsum("whd,hnd->hwn", capture.queries.float().to(keys.device), keys) * layer.scale
        qpos = capture.query_positions.to(keys.device).view(1, -1, 1)
        key_pos = positions.repeat_interleave(group, dim=0).unsqueeze(1)  # [Hq, 1, N]
        visible = (key_pos >= 0) & (key_pos <= qpos)
        # The ring's keys also take part in the softmax; they are not candidates, so they are left out
        # of the normaliser too: only relative order among global entries matters for eviction.
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
        votes = reduce_group(probs.mean(dim=1), heads, self.gqa_reduction)
        scores = pool_scores(votes, self.kernel_size, self.pooling, self.count_include_pad)
        valid = positions >= 0
        return {"scores": scores.masked_fill(~valid, 0.0).cpu(), "positions": positions.cpu().to(torch.int64)}

    def plan(self, request: RequestPrefill, layer_results: list[Any], state: dict[str, Any]) -> KeepPlan | None:
        if self.cap is None:
            return None
        # Layers admitted different numbers of tokens: pad every layer to the widest (-1 = no entry).
        width = max(r["positions"].shape[-1] for r in layer_results)
        pad = [(0, width - r["positions"].shape[-1]) for r in layer_results]
        positions = torch.stack(
            [torch.nn.functional.pad(r["positions"], p, value=-1) for r, p in zip(layer_results, pad, strict=True)]
        )  # [L, H, N]
        scores = torch.stack([torch.nn.functional.pad(r["scores"], p) for r, p in zip(layer_results, pad, strict=True)])
        valid = positions >= 0
        limit = self.cap * request.num_kv_heads
        keep = valid.clone()
        triggers = 0
        for layer in range(positions.shape[0]):
            total = int(valid[layer].sum())
            if total > limit:
                keep[layer] = _top_across_heads(scores[layer], valid[layer], limit)
                triggers += 1
        state["positions"] = positions.masked_fill(~keep, -1)
        state["scores"] = scores.masked_fill(~keep, 0.0)
        state["counters"] = {"eviction_triggers": triggers}
        return KeepPlan.from_mask(keep)

    def on_decode_step(self, step: DecodeStep, state: dict[str, Any]) -> DecodeEviction | None:
        assert self.cap is not None
        positions = torch.stack([layer.positions for layer in step.layers]).to(torch.int64)  # [L, H, N]
        valid = positions >= 0
        attention = torch.zeros(positions.shape, dtype=torch.float32)
        for index, layer in enumerate(step.layers):
            if layer.attention is None:
                raise RuntimeError("wgkv with a cap needs each decode step's attention; the engine passed none")
            probs = reduce_decode_attention(layer.attention.cpu(), self.gqa_reduction)[:, : positions.shape[-1]]
            attention[index, :, : probs.shape[-1]] = probs
        old_positions, old_scores = state["positions"], state["scores"]
        seen = realign(old_positions, torch.ones_like(old_scores), positions) > 0
        rate = 1.0 / self.observation_window
        previous = realign(old_positions, old_scores, positions)
        scores = torch.where(seen, (1.0 - rate) * previous + rate * attention, attention).masked_fill(~valid, 0.0)
        limit = self.cap * positions.shape[1]
        drop = torch.zeros_like(valid)
        for index in range(positions.shape[0]):
            total = int(valid[index].sum())
            if total > limit:
                count = max(1, math.ceil(self.evict_fraction * total))
                drop[index] = valid[index] & ~_top_across_heads(scores[index], valid[index], total - count)
                state["counters"]["eviction_triggers"] += 1
        kept = valid & ~drop
        state["positions"] = positions.masked_fill(~kept, -1)
        state["scores"] = scores.masked_fill(~kept, 0.0)
        return evictions(drop) if bool(drop.any()) else None


def _top_across_heads(scores: torch.Tensor, valid: torch.Tensor, count: int) -> torch.Tensor:
    """Bool `[H, N]`: the `count` best valid entries of a layer, ranked across its heads (ties: lower index)."""
    flat = scores.float().masked_fill(~valid, float("-inf")).reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices[:count]
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[order] = True
    return keep.view(valid.shape) & valid
